"""Tests for specdecode.verify.

1. Table cases computed by hand.            4. Seeded determinism.
2. Fast path == slow reference (identical    5. Losslessness: 1e5 seeded trials per mode and
   uniforms), chain / point mass / match /      sampling setting; the joint of the first 3
   tree, ragged.                                emitted tokens vs the exact autoregressive
3. T = 0 == greedy (chain, match, tree).        joint of a context-dependent toy target
                                                (chi-square), and a wrong verifier is caught.
"""

from __future__ import annotations

import pytest
import reference_verify as ref
import torch
from scipy import stats

from specdecode.config import SamplingParams
from specdecode.drafter import Proposal
from specdecode.sampling import draw_uniforms, process_logits, sample
from specdecode.tree import DraftTree, tree_depths, tree_from_paths
from specdecode.verify import (
    verify_chain,
    verify_chain_block,
    verify_chain_match,
    verify_step,
    verify_tree,
    verify_tree_batch,
    verify_tree_greedy,
)

# p at block rows 0..2 and q at rows 0..1 for the hand-computed chain cases (V = 3).
P3 = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
Q2 = torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.3, 0.6]])


def _chain(draft, uniforms, q=Q2, num_draft=None):
    nd = None if num_draft is None else torch.tensor([num_draft])
    v = verify_chain(
        torch.tensor([draft]), None if q is None else q[None], P3[None], torch.tensor([uniforms]), nd
    )
    return int(v.num_accepted[0]), v.emitted_ids[0].tolist(), int(v.num_emitted[0])


# ---------------------------------------------------------------- 1. table cases
@pytest.mark.parametrize(
    ("draft", "uniforms", "q", "num_draft", "expected"),
    [
        # p0(0)/q0(0) = 2: always accepted; p1(2)/q1(2) = 0.5: u = 0.4 accepts; bonus from p2, u = 0.5 -> 2
        ([0, 2], [0.99, 0.4, 0.5], Q2, None, (2, [0, 2, 2, -1][:3], 3)),
        # u = 0.6 rejects x = 2; residual max(0, p1 - q1) = [0, 0.3, 0] -> recovered 1 for any u
        ([0, 2], [0.0, 0.6, 0.999], Q2, None, (1, [0, 1, -1], 2)),
        # first draft x = 1: p0/q0 = 0.6, u = 0.7 rejects; residual [0.25, 0, 0] -> 0
        ([1, 2], [0.7, 0.0, 0.9], Q2, None, (0, [0, -1, -1], 1)),
        # point mass: p0(1) = 0.3 accepts u = 0.2; p1(1) = 0.6 rejects u = 0.7;
        # p1 without id 1 = [0.25, 0, 0.75]: u = 0.2 -> 0, u = 0.3 -> 2
        ([1, 1], [0.2, 0.7, 0.2], None, None, (1, [1, 0, -1], 2)),
        ([1, 1], [0.2, 0.7, 0.3], None, None, (1, [1, 2, -1], 2)),
        # ragged: one draft, accepted; bonus from p1 = [0.1, 0.6, 0.3] with u = 0.05 -> 0
        ([0, 2], [0.0, 0.0, 0.05], Q2, 1, (1, [0, 0, -1], 2)),
        # no drafts: bonus from p0, u = 0.85 -> 2; padded draft ids are ignored
        ([-1, -1], [0.0, 0.0, 0.85], Q2, 0, (0, [2, -1, -1], 1)),
    ],
)
def test_verify_chain_table(draft, uniforms, q, num_draft, expected):
    assert _chain(draft, uniforms, q, num_draft) == expected


def test_verify_chain_match_table():
    # Target samples with u = [0.55, 0.75, 0.1]: row 0 -> 1, row 1 -> 2, row 2 -> 0.
    v = verify_chain_match(
        torch.tensor([[1, 2], [1, 0], [0, 2]]),
        P3.expand(3, 3, 3),
        torch.tensor([[0.55, 0.75, 0.1]]).expand(3, 3),
        torch.tensor([2, 2, 2]),
    )
    assert v.num_accepted.tolist() == [2, 1, 0]
    assert v.emitted_ids.tolist() == [[1, 2, 0], [1, 2, -1], [1, -1, -1]]
    assert v.num_emitted.tolist() == [3, 2, 1]


def test_verify_chain_zero_drafts():
    v = verify_chain(
        torch.zeros(2, 0, dtype=torch.long), None, P3[:1].expand(2, 1, 3), torch.tensor([[0.1], [0.9]])
    )
    assert v.emitted_ids.tolist() == [[0], [2]] and v.num_accepted.tolist() == [0, 0]


def test_degenerate_residual_falls_back_to_p():
    # An (invalid) q that dominates p everywhere makes max(0, p - q) all zero: sample from p.
    q = torch.tensor([[[0.6, 0.6]]])
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    v = verify_chain(torch.tensor([[0]]), q, p, torch.tensor([[0.9, 0.7]]))
    assert v.emitted_ids.tolist() == [[1, -1]]
    tree = DraftTree(tokens=torch.tensor([0]), parents=torch.tensor([-1]))
    t = verify_tree(tree, p[0], q[0], torch.tensor([0.7, 0.9]), iid=True)
    assert t.emitted_ids.tolist() == [1]


@pytest.mark.parametrize(
    ("iid", "uniforms", "accepted", "emitted", "kept"),
    [
        # u(n0) = 0.4 < p(0) = 0.5: accept n0 -> row 1; u(n2) = 0.2 < p1(2) = 0.3: accept -> row 3;
        # final from p3 = [0.2, 0.2, 0.6] with u = 0.9 -> 2
        (False, [0.9, 0.4, 0.0, 0.2], [0, 2], [0, 2, 2], [0, 1, 3]),
        # reject n0 (0.6): p -> [0, 0.6, 0.4]; n1 (token 1) accepted with u = 0.5 < 0.6; leaf;
        # final from row 2 = [0.1, 0.6, 0.3] with u = 0.05 -> 0
        (False, [0.05, 0.6, 0.5, 0.0], [1], [1, 0], [0, 2]),
        # reject n0, then n1 (0.7 >= 0.6): p -> [0, 0, 1]: final 2
        (False, [0.0, 0.6, 0.7, 0.0], [], [2], [0]),
        # iid, q = [0.25, 0.5, 0.25] for every node: n0 p/q = 2 accepted; n2 p1(2)/q(2) = 1.2 accepted
        (True, [0.9, 0.99, 0.0, 0.99], [0, 2], [0, 2, 2], [0, 1, 3]),
        # iid at row 0 with n0 = token 1 (p/q = 0.6, u = 0.7 rejects): p -> norm(max(0, p - q)) = [1, 0, 0];
        # n1 = token 1 now has p = 0: rejected; residual [0.75, 0, 0] -> final 0
        (True, [0.5, 0.7, 0.0, 0.0], [], [0], [0]),
    ],
)
def test_verify_tree_table(iid, uniforms, accepted, emitted, kept):
    tokens = torch.tensor([0, 1, 2]) if not (iid and accepted == []) else torch.tensor([1, 1, 2])
    tree = DraftTree(tokens=tokens, parents=torch.tensor([-1, -1, 0]))
    p = torch.stack([P3[0], P3[1], P3[1], P3[2]])  # rows: root, n0, n1, n2
    q = Q2[0].expand(3, 3) if iid else None
    v = verify_tree(tree, p, q, torch.tensor(uniforms), iid=iid)
    assert v.accepted_nodes.tolist() == accepted
    assert v.emitted_ids.tolist() == emitted
    assert v.kept_rows.tolist() == kept
    assert v.num_accepted == len(accepted)


def test_verify_tree_needs_q_when_iid():
    tree = DraftTree(tokens=torch.tensor([0]), parents=torch.tensor([-1]))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_tree(tree, P3[:2], None, torch.zeros(2), iid=True)


# ---------------------------------------------------------------- 2. fast == slow reference
def _random_probs(g, shape, V, top_k):
    return process_logits(2 * torch.randn(*shape, V, generator=g), SamplingParams(1.0, top_k=top_k))


@pytest.mark.parametrize("mode", ["q", "point", "match"])
def test_chain_matches_reference(mode):
    g = torch.Generator().manual_seed(5)
    B, K, V = 400, 4, 8
    p = _random_probs(g, (B, K + 1), V, top_k=5)
    q = _random_probs(g, (B, K), V, top_k=5)
    drafts = sample(q, torch.rand(B, K, generator=g))
    drafts[:50] = torch.randint(0, V, (50, K), generator=g)  # some drafts q cannot produce
    drafts[50:100] = p[50:100, :K].argmax(-1)  # some long accepted runs
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand(B, K + 1, generator=g)
    for nd in [None, num_draft]:
        if mode == "match":
            v = verify_chain_match(drafts, p, u, nd)
            n, emitted = ref.ref_verify_chain_match(drafts, p, u, nd)
        else:
            qq = q if mode == "q" else None
            v = verify_chain(drafts, qq, p, u, nd)
            n, emitted = ref.ref_verify_chain(drafts, qq, p, u, nd)
        assert v.num_accepted.tolist() == n
        assert torch.equal(v.num_emitted, v.num_accepted + 1)
        assert ref.rows_as_lists(v.emitted_ids, v.num_emitted) == emitted
        padding = torch.arange(K + 1) >= v.num_emitted[:, None]
        assert (v.emitted_ids[padding] == -1).all()


@pytest.mark.parametrize("iid", [True, False])
@pytest.mark.parametrize("tree_seed", [0, 1, 2])
def test_tree_matches_reference(iid, tree_seed):
    g = torch.Generator().manual_seed(100 + tree_seed)
    N, V, B = 9, 6, 200
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i > 0 else -1 for i in range(N)]
    p = _random_probs(g, (B, N + 1), V, top_k=4)
    q = _random_probs(g, (B, N), V, top_k=4)
    tokens = sample(q, torch.rand(B, N, generator=g))
    tokens[: B // 2] = p[: B // 2, [pa + 1 for pa in parents]].argmax(-1)  # deep accepted paths
    u = torch.rand(B, N + 1, generator=g)
    batch = verify_tree_batch(torch.tensor(parents), tokens, q if iid else None, p, u, iid)
    for b in range(B):
        path, emitted = ref.ref_verify_tree(parents, tokens[b], p[b], q[b], u[b], iid)
        one = verify_tree(
            DraftTree(tokens[b], torch.tensor(parents)), p[b], q[b] if iid else None, u[b], iid=iid
        )
        assert one.accepted_nodes.tolist() == path
        assert one.emitted_ids.tolist() == emitted
        assert one.kept_rows.tolist() == [0] + [c + 1 for c in path]
        a = len(path)
        assert int(batch.num_accepted[b]) == a
        assert batch.emitted_ids[b, : a + 1].tolist() == emitted
        assert (batch.emitted_ids[b, a + 1 :] == -1).all() and (batch.kept_rows[b, a + 1 :] == -1).all()


# ---------------------------------------------------------------- 3. T = 0 is greedy
def test_chain_greedy_exact():
    g = torch.Generator().manual_seed(9)
    B, K, V = 300, 5, 7
    greedy = SamplingParams(temperature=0.0)
    p = process_logits(torch.randn(B, K + 1, V, generator=g), greedy)
    q = process_logits(torch.randn(B, K, V, generator=g), greedy)
    argmax = p.argmax(-1)  # [B, K+1]
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.8, argmax[:, :K], q.argmax(-1))
    u = torch.rand(B, K + 1, generator=g)
    for v in [
        verify_chain(drafts, q, p, u),
        verify_chain(drafts, None, p, u),
        verify_chain_match(drafts, p, u),
    ]:
        for b in range(B):
            n = 0
            while n < K and drafts[b, n] == argmax[b, n]:
                n += 1
            assert int(v.num_accepted[b]) == n
            assert v.emitted_ids[b, : n + 1].tolist() == drafts[b, :n].tolist() + [int(argmax[b, n])]


@pytest.mark.parametrize("iid", [True, False])
def test_tree_greedy_is_longest_argmax_path(iid):
    g = torch.Generator().manual_seed(21)
    N, V = 12, 16  # V > N, so siblings can always be made distinct
    greedy = SamplingParams(temperature=0.0)
    for _ in range(100):
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i > 0 else -1 for i in range(N)]
        p = process_logits(torch.randn(N + 1, V, generator=g), greedy)
        q = process_logits(torch.randn(N, V, generator=g), SamplingParams(1.0))
        # distinct siblings, mostly argmax tokens so paths get deep
        tokens = torch.randint(0, V, (N,), generator=g)
        tokens = torch.where(
            torch.rand(N, generator=g) < 0.7, p[[pa + 1 for pa in parents]].argmax(-1), tokens
        )
        for i, pa in enumerate(parents):
            while any(parents[j] == pa and tokens[j] == tokens[i] for j in range(i)):
                tokens[i] = (tokens[i] + 1) % V
        tree = DraftTree(tokens, torch.tensor(parents))
        v = verify_tree(tree, p, q if iid else None, torch.Generator().manual_seed(3), iid=iid)
        path, emitted = ref.greedy_tree_path(parents, tokens, p)
        assert v.accepted_nodes.tolist() == path
        assert v.emitted_ids.tolist() == emitted


# ---------------------------------------------------------------- 4. seeded determinism
def test_seeded_determinism():
    g = torch.Generator().manual_seed(4)
    B, K, V = 16, 4, 8
    p = _random_probs(g, (B, K + 1), V, top_k=0)
    q = _random_probs(g, (B, K), V, top_k=0)
    drafts = sample(q, torch.rand(B, K, generator=g))

    def run(seeds):
        u = draw_uniforms([torch.Generator().manual_seed(s) for s in seeds], K + 1)
        return verify_chain(drafts[: len(seeds)], q[: len(seeds)], p[: len(seeds)], u).emitted_ids

    seeds = list(range(B))
    assert torch.equal(run(seeds), run(seeds))
    tree = DraftTree(tokens=drafts[0], parents=torch.tensor([-1, -1, 0, 1]))
    a = verify_tree(tree, p[0], q[0], torch.Generator().manual_seed(8), iid=True)
    b = verify_tree(tree, p[0], q[0], torch.Generator().manual_seed(8), iid=True)
    assert a.emitted_ids.tolist() == b.emitted_ids.tolist()


# ---------------------------------------------------------------- 5. losslessness
# Toy context-dependent LMs: p(. | last two tokens), q(. | last two tokens) over VOCAB ids, with one
# padded head row (id VOCAB) holding a large logit that must never be emitted.
VOCAB, V_HEAD, L, K, TRIALS = 6, 7, 3, 3, 100_000
NS = V_HEAD + 1  # a context slot holds a token (padded ids included) or "none"
TREE = tree_from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])

SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7": SamplingParams(temperature=0.7),
    "T1-topk4": SamplingParams(temperature=1.0, top_k=4),
    "T0.7-topp0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "T1-topk5-topp0.9": SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    "T0": SamplingParams(temperature=0.0),
}


def _next_state(state, tok):  # state = (prev2 + 1) * NS + (prev1 + 1)
    return (state % NS) * NS + tok + 1


def _toy_tables(params):
    g = torch.Generator().manual_seed(1234)
    target_logits = 1.2 * torch.randn(NS * NS, V_HEAD, generator=g)
    # A drafter that agrees often but not always: every accept / reject branch carries mass.
    draft_logits = target_logits + 0.7 * torch.randn(NS * NS, V_HEAD, generator=g)
    target_logits[:, VOCAB] = draft_logits[:, VOCAB] = 6.0
    return process_logits(target_logits, params, VOCAB), process_logits(draft_logits, params, VOCAB)


def _exact_joint(p):  # [V_HEAD ** L] float64: P(t1, t2, t3) under autoregressive sampling from p
    p = p.double()
    s1 = torch.arange(V_HEAD) + 1  # state after one token (context was empty)
    j2 = p[0][:, None] * p[s1]  # [a, b]
    s2 = (torch.arange(V_HEAD)[:, None] + 1) * NS + torch.arange(V_HEAD)[None] + 1  # [a, b]
    j3 = j2[..., None] * p[s2]  # [a, b, c]
    return (j3 / j3.sum()).flatten()


def _draft_chain(q, state, g, greedy):
    ids, qs, states = [], [], [state]
    for _ in range(K):
        qk = q[states[-1]]
        x = qk.argmax(-1) if greedy else sample(qk, torch.rand(TRIALS, generator=g))
        ids.append(x)
        qs.append(qk)
        states.append(_next_state(states[-1], x))
    return torch.stack(ids, 1), torch.stack(qs, 1), torch.stack(states, 1)


def _step_chain(p, q, state, g, rule=verify_chain):  # rule: verify_chain or verify_chain_block
    ids, qs, states = _draft_chain(q, state, g, greedy=False)
    num_draft = torch.randint(0, K + 1, (TRIALS,), generator=g)  # ragged
    v = rule(ids, qs, p[states], torch.rand(TRIALS, K + 1, generator=g), num_draft)
    return v.emitted_ids, v.num_emitted


def _step_point(p, q, state, g, rule=verify_chain):
    ids, _, states = _draft_chain(q, state, g, greedy=True)  # a deterministic drafter
    v = rule(ids, None, p[states], torch.rand(TRIALS, K + 1, generator=g))
    return v.emitted_ids, v.num_emitted


def _step_match(p, q, state, g):
    ids, _, states = _draft_chain(q, state, g, greedy=False)
    v = verify_chain_match(ids, p[states], torch.rand(TRIALS, K + 1, generator=g))
    return v.emitted_ids, v.num_emitted


def _step_tree(p, q, state, g, iid, topk_children=None):
    iid_children = iid if topk_children is None else not topk_children
    node_states, tokens, qs = [], [], []
    for pa, rank in zip(TREE.parents.tolist(), TREE.ranks.tolist(), strict=True):
        parent_state = state if pa == -1 else node_states[pa]
        qn = q[parent_state]
        if iid_children:  # i.i.d. draws from q at the parent
            x = sample(qn, torch.rand(TRIALS, generator=g))
        else:  # deterministic: the rank-th most likely draft token
            x = torch.topk(qn, 3, dim=-1).indices[:, rank]
        tokens.append(x)
        qs.append(qn)
        node_states.append(_next_state(parent_state, x))
    target = p[torch.stack([state] + node_states, 1)]
    uniforms = torch.rand(TRIALS, len(tokens) + 1, generator=g)
    v = verify_tree_batch(TREE.parents, torch.stack(tokens, 1), torch.stack(qs, 1), target, uniforms, iid)
    return v.emitted_ids, v.num_emitted


def _step_chain_wrong(p, q, state, g):
    """Bug: the token after the accepted prefix comes from p itself instead of the residual."""
    ids, qs, states = _draft_chain(q, state, g, greedy=False)
    target = p[states]
    u = torch.rand(TRIALS, K + 1, generator=g)
    v = verify_chain(ids, qs, target, u)
    rows = torch.arange(TRIALS)
    emitted = v.emitted_ids.clone()
    emitted[rows, v.num_accepted] = sample(target[rows, v.num_accepted], u[:, K])
    return emitted, v.num_emitted


def _step_block_wrong(p, q, state, g):
    """Bug: block verification's stop test reads w_i (the prefix's weight) in place of h_i."""
    ids, qs, states = _draft_chain(q, state, g, greedy=False)
    target = p[states]
    u = torch.rand(TRIALS, K + 1, generator=g)
    p_x = target[:, :K].gather(-1, ids[..., None]).squeeze(-1).double()
    q_x = qs.gather(-1, ids[..., None]).squeeze(-1).double()
    w = torch.cumprod((p_x / q_x).clamp(max=1.0), 1)  # a lower bound of w_i: the same stop rule's shape
    stops = u[:, :K].double() <= w
    num_accepted = torch.where(stops, torch.arange(1, K + 1), 0).amax(1)
    v = verify_chain_block(ids, qs, target, u)
    emitted = v.emitted_ids.clone()
    rows = torch.arange(TRIALS)
    emitted[:, :K] = torch.where(torch.arange(K)[None] < num_accepted[:, None], ids, -1)
    emitted[:, K] = -1
    emitted[rows, num_accepted] = sample(target[rows, num_accepted], u[:, K])
    return emitted, num_accepted + 1


MODES = {
    "chain": _step_chain,
    "chain-point-mass": _step_point,
    "block": lambda p, q, s, g: _step_chain(p, q, s, g, rule=verify_chain_block),
    "block-point-mass": lambda p, q, s, g: _step_point(p, q, s, g, rule=verify_chain_block),
    "sample-then-match": _step_match,
    "tree-iid": lambda p, q, s, g: _step_tree(p, q, s, g, iid=True),
    "tree-topk": lambda p, q, s, g: _step_tree(p, q, s, g, iid=False),
}
WRONG = {
    "chain-recovered-from-p": _step_chain_wrong,
    "block-stops-on-the-prefix-weight": _step_block_wrong,
    # iid rule applied to deterministic top-k children (SpecInfer's rule needs i.i.d. children)
    "tree-iid-rule-on-topk": lambda p, q, s, g: _step_tree(p, q, s, g, iid=True, topk_children=True),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Small-tensor ops run many times faster on one thread than on contended OpenMP threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _simulate(step, p, q, seed):  # [TRIALS, L]: the first L emitted tokens of every trial
    g = torch.Generator().manual_seed(seed)
    out = torch.full((TRIALS, L), -1, dtype=torch.long)
    count = torch.zeros(TRIALS, dtype=torch.long)
    state = torch.zeros(TRIALS, dtype=torch.long)  # empty context
    rows = torch.arange(TRIALS)
    for _ in range(L):  # every step emits >= 1 token; trials already done just keep going
        emitted, num_emitted = step(p, q, state, g)
        for j in range(emitted.shape[1]):
            ok = j < num_emitted
            tok = emitted[:, j]
            write = ok & (count + j < L)
            out[rows[write], (count + j)[write]] = tok[write]
            state = torch.where(ok, _next_state(state, tok.clamp_min(0)), state)
        count += num_emitted
    assert (count >= L).all()
    return out


def _chi_square_pvalue(out, joint):
    codes = (out * torch.tensor([V_HEAD * V_HEAD, V_HEAD, 1])).sum(1)
    counts = torch.bincount(codes, minlength=V_HEAD**L).double()
    expected = joint * TRIALS
    assert counts[expected == 0].sum() == 0, "emitted a sequence the target gives probability 0"
    obs, exp = counts[expected > 0], expected[expected > 0]
    if obs.numel() == 1:
        return 1.0
    small = exp < 5  # pool sparse cells so the chi-square approximation holds
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", list(MODES))
def test_lossless_joint_distribution(mode, setting):
    p, q = _toy_tables(SETTINGS[setting])
    joint = _exact_joint(p)
    out = _simulate(MODES[mode], p, q, seed=2024)
    assert (out < VOCAB).all(), "emitted a padded vocabulary id"
    if setting == "T0":  # greedy: every trial emits the argmax path
        greedy_path = torch.stack(torch.unravel_index(joint.argmax(), (V_HEAD,) * L))
        assert (out == greedy_path).all()
    pvalue = _chi_square_pvalue(out, joint)
    assert pvalue > 1e-4, f"{mode} at {setting}: emitted joint differs from p (chi-square p = {pvalue:.2e})"


@pytest.mark.parametrize("setting", ["T1", "T1-topk5-topp0.9"])
@pytest.mark.parametrize("wrong", list(WRONG))
def test_wrong_verifier_is_detected(wrong, setting):
    p, q = _toy_tables(SETTINGS[setting])
    out = _simulate(WRONG[wrong], p, q, seed=2024)
    pvalue = _chi_square_pvalue(out, _exact_joint(p))
    assert pvalue < 1e-8, f"the statistic failed to catch {wrong} (chi-square p = {pvalue:.2e})"


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="uniforms has shape"):
        verify_chain(torch.tensor([[0, 2]]), Q2[None], P3[None], torch.zeros(1, 2))
    with pytest.raises(ValueError, match="target_probs has shape"):
        verify_chain_match(torch.tensor([[0, 2, 1]]), P3[None], torch.zeros(1, 4))
    tree = DraftTree(tokens=torch.tensor([0, 1]), parents=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="draft_probs has shape"):
        verify_tree(tree, P3, Q2[:1], torch.zeros(3), iid=True)


# ---------------------------------------------------------------- 6. the loop's verify step
def _random_tree(g, n: int) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=g)) if i > 0 else -1 for i in range(n)]


@pytest.mark.parametrize("iid", [True, False])
def test_tree_batch_of_different_shapes_equals_each_tree_alone(iid):
    """Rows with their own parent arrays and node counts (absent nodes -1) verify exactly as each
    tree does alone: batching trees changes nothing."""
    g = torch.Generator().manual_seed(7)
    B, N, V = 40, 8, 6
    sizes = [int(torch.randint(0, N + 1, (1,), generator=g)) for _ in range(B)]
    parents = torch.full((B, N), -1, dtype=torch.long)
    for b, n in enumerate(sizes):
        parents[b, :n] = torch.tensor(_random_tree(g, n), dtype=torch.long)
    p = _random_probs(g, (B, N + 1), V, top_k=4)
    q = _random_probs(g, (B, N), V, top_k=4)
    tokens = sample(q, torch.rand(B, N, generator=g))
    tokens[::2] = p[torch.arange(0, B, 2)[:, None], parents[::2] + 1].argmax(-1)  # deep paths
    tokens[torch.arange(N)[None] >= torch.tensor(sizes)[:, None]] = -1
    u = torch.rand(B, N + 1, generator=g)
    batch = verify_tree_batch(parents, tokens, q if iid else None, p, u, iid)
    deepest = 0
    for b, n in enumerate(sizes):
        tree = DraftTree(tokens[b, :n], parents[b, :n])
        one = verify_tree(tree, p[b, : n + 1], q[b, :n] if iid else None, u[b, : n + 1], iid=iid)
        a = one.num_accepted
        deepest = max(deepest, a)
        assert int(batch.num_accepted[b]) == a
        assert batch.emitted_ids[b, : a + 1].tolist() == one.emitted_ids.tolist()
        assert batch.kept_rows[b, : a + 1].tolist() == one.kept_rows.tolist()
        depth = 0 if n == 0 else int(tree_depths(parents[b, :n]).max())
        assert int(batch.depth[b]) == depth
    assert deepest >= 2  # the test exercised multi-node accepted paths


@pytest.mark.parametrize("iid", [True, False])
def test_greedy_trees_skip_the_distributions_and_verify_the_same(iid):
    """verify_tree_greedy == verify_tree_batch on one-hot p (what T = 0 processing gives), rows
    of different shapes, duplicate siblings included; the head's rows past the vocabulary lose."""
    g = torch.Generator().manual_seed(8)
    B, N, V = 40, 8, 5  # a small V makes duplicate siblings and argmax hits common
    sizes = [int(torch.randint(0, N + 1, (1,), generator=g)) for _ in range(B)]
    parents = torch.full((B, N), -1, dtype=torch.long)
    for b, n in enumerate(sizes):
        parents[b, :n] = torch.tensor(_random_tree(g, n), dtype=torch.long)
    logits = torch.randn(B, N + 1, V + 2, generator=g)
    logits[..., V:] = 50.0  # rows the tokenizer cannot emit
    p = process_logits(logits, SamplingParams(temperature=0.0), V)  # one-hot [B, N + 1, V + 2]
    tokens = torch.randint(0, V, (B, N), generator=g)
    tokens[::2] = logits[..., :V].argmax(-1)[torch.arange(0, B, 2)[:, None], parents[::2] + 1]
    tokens[torch.arange(N)[None] >= torch.tensor(sizes)[:, None]] = -1
    q = _random_probs(g, (B, N), V + 2, top_k=4)
    want = verify_tree_batch(parents, tokens, q if iid else None, p, torch.rand(B, N + 1, generator=g), iid)
    got = verify_tree_greedy(parents, tokens, logits[..., :V])
    for b, (emitted, kept, depth) in enumerate(got):
        a = int(want.num_accepted[b])
        assert emitted == want.emitted_ids[b, : a + 1].tolist()
        assert kept == want.kept_rows[b, : a + 1].tolist()
        assert depth == int(want.depth[b])
    assert max(len(k) for _, k, _ in got) >= 3  # multi-node accepted paths were exercised


class _Stream:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self._table = torch.rand(64, generator=torch.Generator().manual_seed(seed + 1000))

    def sample_uniforms(self, start: int, n: int) -> torch.Tensor:
        return self._table[start : start + n]


@pytest.mark.parametrize("tree", [False, True])
def test_verify_step_batch_equals_single(tree):
    """A request's verdict does not depend on its neighbours (same seed, same proposal row)."""
    g = torch.Generator().manual_seed(11)
    B, K, V = 6, 4, 8
    nd = torch.tensor([0, 4, 2, 4, 1, 3])
    draft_ids = torch.randint(0, V, (B, K), generator=g)
    q = _random_probs(g, (B, K), V, top_k=5)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    parents = None
    if tree:
        parents = torch.tensor([[-1, 0, 0, 1]] * B)
    prop = Proposal(draft_ids=draft_ids, num_draft=nd, draft_probs=q, parents=parents, tree_iid=tree)
    params = [SamplingParams(temperature=1.0)] * B
    together = verify_step(prop, logits, params, [_Stream(b) for b in range(B)], [3] * B, V)
    for b in range(B):
        row = Proposal(
            draft_ids=draft_ids[b : b + 1],
            num_draft=nd[b : b + 1],
            draft_probs=q[b : b + 1],
            parents=None if parents is None else parents[b : b + 1],
            tree_iid=tree,
        )
        alone = verify_step(row, logits[b : b + 1], params[:1], [_Stream(b)], [3], V)[0]
        assert alone == together[b]
        v = together[b]
        assert v.num_draft == int(nd[b]) and len(v.kept_rows) == v.num_accepted + 1
        assert 0 <= v.num_accepted <= v.depth <= v.num_draft


def test_verify_step_greedy_is_the_argmax_path():
    g = torch.Generator().manual_seed(12)
    B, K, V = 5, 3, 7
    logits = torch.randn(B, K + 1, V + 2, generator=g)  # the head has 2 rows past the vocabulary
    logits[..., V:] = 50.0  # rows the tokenizer cannot emit must never win
    argmax = logits[..., :V].argmax(-1)
    drafts = argmax[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # row 1 diverges at draft 2
    prop = Proposal(draft_ids=drafts, num_draft=torch.tensor([3, 3, 0, 2, 3]))
    params = [SamplingParams(temperature=0.0)] * B
    verdicts = verify_step(prop, logits, params, [_Stream(b) for b in range(B)], [0] * B, V)
    assert [v.num_accepted for v in verdicts] == [3, 1, 0, 2, 3]
    for b, v in enumerate(verdicts):
        assert v.emitted_ids == argmax[b, : v.num_accepted + 1].tolist()
        assert v.kept_rows == list(range(v.num_accepted + 1))
