"""verify_native: our CPU kernel's chain and tree verdicts against the tensor path of specdecode.verify.

Greedy verdicts and argmaxes must be identical; sampled verdicts (rejection and sample-then-match)
must be the tensor path's for the same uniforms except where a uniform falls within rounding of a
boundary, and a request's verdict must not depend on its batch or on the number of threads. The
loop-level distribution tests (tests/stat) check the kernel's losslessness at T = 1.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.drafter import Proposal
from specdecode.models import kernels
from specdecode.sampling import process_logits_batch
from specdecode.verify import verify_chain, verify_chain_block, verify_chain_match, verify_greedy
from specdecode.verify_native import argmax_ids, native_chain, native_tree

pytestmark = pytest.mark.skipif(kernels.fused() is None, reason="our CPU kernels are not built here")


def _case(B, K, V, pad=0, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V + pad, generator=g) * scale
    logits[..., V:] = 50.0  # padded head rows: larger than any real logit, never chosen
    q = torch.softmax(torch.randn(B, K, V + pad, generator=g) * scale, -1)
    q[..., V:] = 0.0
    q = q / q.sum(-1, keepdim=True)
    ids = torch.multinomial(q.reshape(-1, V + pad), 1, generator=g).view(B, K)
    return logits, q, ids, g


def test_argmax_is_torch_argmax_with_ties_padding_and_nan():
    logits, _, _, _ = _case(4, 6, 9000, pad=13)
    logits[0, 1, 4100] = logits[0, 1, 8000] = 100.0  # equal maxima in two chunks: the first
    logits[1, 2, :9000] = 0.0  # all equal: id 0
    logits[2, 0, 5000] = float("nan")  # torch.argmax takes the (first) NaN
    logits[2, 0, 7000] = float("nan")
    got = argmax_ids(logits, 9000)
    assert torch.equal(got, logits[..., :9000].argmax(-1))
    assert got[0, 1] == 4100 and got[1, 2] == 0 and got[2, 0] == 5000


@pytest.mark.parametrize("K", [0, 1, 5])
def test_greedy_verdicts_are_the_tensor_path(K):
    for seed in range(20):
        logits, _, ids, g = _case(3, K, 5000, pad=5, seed=seed)
        target = logits[..., :5000].argmax(-1)
        ids = torch.where(torch.rand(3, K, generator=g) < 0.7, target[:, :K], ids)  # long accepted runs
        nd = torch.randint(0, K + 1, (3,), generator=g)
        params = [SamplingParams()] * 3
        acc, final = native_chain(logits, ids, nd, None, torch.rand(3, K + 1, generator=g), params, 5000)
        ref = verify_greedy(ids, logits, nd, 5000)
        assert torch.equal(acc, ref.num_accepted)
        assert torch.equal(final, ref.emitted_ids.gather(1, acc[:, None])[:, 0])


@pytest.mark.parametrize("mode", ["rejection", "block", "match"])
def test_sampled_verdicts_are_the_tensor_paths_for_the_same_uniforms(mode):
    """Mixed batch: T 1, T 0.6, a greedy row, rows without drafts; 400 uniforms draws each."""
    B, K, V = 5, 4, 3000
    params = [SamplingParams(temperature=t) for t in (1.0, 0.6, 0.0, 1.0, 0.6)]
    nd = torch.tensor([4, 3, 4, 0, 2])
    logits, q, ids, g = _case(B, K, V, pad=8, seed=1, scale=6.0 if mode == "match" else 2.0)
    q_arg = None if mode == "match" else q
    if mode == "match":  # point-mass drafts on the target's mode: matched often
        ids = logits[:, :K, :V].argmax(-1)
    p = process_logits_batch(logits, params, V)
    same = total = 0
    accepted = 0
    for _ in range(400):
        u = torch.rand(B, K + 1, generator=g)
        acc, final = native_chain(logits, ids, nd, q_arg, u, params, V, block=mode == "block")
        if mode == "rejection":
            ref = verify_chain(ids, q, p, u, nd)
        elif mode == "block":
            ref = verify_chain_block(ids, q, p, u, nd)
        else:
            ref = verify_chain_match(ids, p, u, nd)
        ref_final = ref.emitted_ids.gather(1, ref.num_accepted[:, None])[:, 0]
        same += int(((acc == ref.num_accepted) & (final == ref_final)).sum())
        total += B
        accepted += int(acc.sum())
        assert bool((final < V).all()) and bool((acc <= nd).all())
    assert accepted > 0
    assert same >= total - 2, f"{total - same} of {total} verdicts differ from the tensor path"


@pytest.mark.parametrize("block", [False, True])
def test_a_verdict_does_not_depend_on_the_batch_or_the_threads(block):
    B, K, V = 6, 5, 20000
    logits, q, ids, g = _case(B, K, V, seed=2)
    params = [SamplingParams(temperature=1.0)] * B
    nd = torch.tensor([5, 5, 2, 0, 5, 3])
    u = torch.rand(B, K + 1, generator=g)
    acc, final = native_chain(logits, ids, nd, q, u, params, V, block=block)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # chunks shared out differently; the sums do not move
            torch.set_num_threads(n)
            acc1, final1 = native_chain(logits, ids, nd, q, u, params, V, block=block)
            assert torch.equal(acc, acc1) and torch.equal(final, final1)
    finally:
        torch.set_num_threads(threads)
    for b in range(B):
        one = slice(b, b + 1)
        a, f = native_chain(logits[one], ids[one], nd[one], q[one], u[one], params[:1], V, block=block)
        assert (int(a), int(f)) == (int(acc[b]), int(final[b]))


def test_not_applicable_where_the_kernel_does_not_cover_the_request():
    logits, q, ids, _ = _case(2, 2, 100)
    u, nd = torch.rand(2, 3), torch.tensor([2, 2])
    top_p = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)]
    assert native_chain(logits, ids, nd, q, u, top_p, 100) is None  # top-p: the tensor path
    top_k = [SamplingParams(temperature=1.0, top_k=5)] * 2
    assert native_chain(logits, ids, nd, q, u, top_k, 100) is None
    plain = [SamplingParams(temperature=1.0)] * 2
    assert native_chain(logits, ids, nd, q, u, plain, 100) is not None


def test_bad_input_is_refused_with_a_message():
    logits, q, ids, _ = _case(1, 2, 100)
    ops = kernels.fused()
    with pytest.raises(RuntimeError, match="num_draft"):
        ops.verify_chain(logits, ids, torch.tensor([3]), q, torch.rand(1, 3), torch.ones(1), 100)
    with pytest.raises(RuntimeError, match="temperature"):
        ops.verify_chain(logits, ids, torch.tensor([2]), q, torch.rand(1, 3), torch.tensor([-1.0]), 100)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.verify_chain(logits, ids, torch.tensor([2]), q[..., :50], torch.rand(1, 3), torch.ones(1), 100)


@pytest.mark.parametrize("block", [False, True])
def test_draft_vocabulary_q_gives_the_dense_q_verdicts(block):
    """q over a draft vocabulary (q_ids: its columns' target ids, unsorted, one past the
    vocabulary) decides as the same q scattered to the target's ids: exactly by token-wise
    rejection; by block verification up to the rounding of the residual masses (the ids outside
    the draft vocabulary as one remainder), one verdict in 300 at most."""
    B, K, V, Vd = 3, 4, 6000, 700
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, K + 1, V + 4, generator=g) * 2
    q_ids = torch.randperm(V, generator=g)[:Vd]
    q_ids[-1] = V + 2  # a padded head row: never emittable, p is 0 there
    qc = torch.softmax(torch.randn(B, K, Vd, generator=g) * 3, -1)
    dense = torch.zeros(B, K, V + 4).index_copy_(-1, q_ids, qc)
    ids = q_ids[torch.multinomial(qc[..., :-1].reshape(-1, Vd - 1), 1, generator=g).view(B, K)]
    ids[0, 1] = int(torch.tensor([i for i in range(V) if i not in set(q_ids.tolist())][0]))  # q = 0 there
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.0)]
    nd = torch.tensor([4, 2, 3])
    accepted = differ = 0
    for _ in range(200):
        u = torch.rand(B, K + 1, generator=g)
        a1, f1 = native_chain(logits, ids, nd, qc, u, params, V, q_ids, block=block)
        a2, f2 = native_chain(logits, ids, nd, dense, u, params, V, block=block)
        differ += int(((a1 != a2) | (f1 != f2)).sum())
        accepted += int(a1.sum())
    assert accepted > 0
    assert differ <= (2 if block else 0), f"{differ} of 600 verdicts differ"


def test_a_proposal_scatters_its_draft_vocabulary_q_for_the_tensor_path():
    q = torch.softmax(torch.randn(2, 3, 5), -1)
    vocab = torch.tensor([7, 1, 4, 9, 0])
    prop = Proposal(torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 3]), q, draft_vocab=vocab)
    dense = prop.dense_probs(12)
    assert dense.shape == (2, 3, 12) and torch.equal(dense[..., vocab], q)
    assert float(dense.sum()) == pytest.approx(6.0) and bool((dense[..., [2, 3, 5, 6, 8, 10, 11]] == 0).all())
    assert Proposal(prop.draft_ids, prop.num_draft, q).dense_probs(12) is q  # dense already


def test_verify_step_reads_a_draft_vocabulary_q_on_both_paths():
    """verify_step with q over a draft vocabulary gives the dense-q verdicts on the kernel (plain
    temperature) and on the tensor path (top-p), for the same request randomness."""
    from specdecode.verify import verify_step

    class Stream:
        def __init__(self):
            self.generator = torch.Generator().manual_seed(9)

        def sample_uniforms(self, start, n):
            return torch.rand(n, generator=self.generator)

    V, Vd, K = 500, 60, 3
    g = torch.Generator().manual_seed(5)
    vocab = torch.randperm(V, generator=g)[:Vd]
    qc = torch.softmax(torch.randn(1, K, Vd, generator=g) * 2, -1)
    ids = vocab[torch.multinomial(qc[0], 1, generator=g).view(1, K)]
    dense = torch.zeros(1, K, V).index_copy_(-1, vocab, qc)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.95)):
        for trial in range(30):
            logits = torch.randn(1, K + 1, V, generator=g) * 2
            got = []
            for q, dv in ((qc, vocab), (dense, None)):
                prop = Proposal(ids, torch.tensor([K]), q, draft_vocab=dv)
                got.append(verify_step(prop, logits, [params], [Stream()], [trial], V)[0].emitted_ids)
            assert got[0] == got[1]


def test_drafts_outside_the_vocabulary_are_rejected_and_never_emitted():
    """Ids past vocab_size (padded head rows with large logits) or negative: p = 0 there."""
    B, K, V = 2, 3, 4000
    logits, q, ids, g = _case(B, K, V, pad=6)
    ids[0, 0], ids[1, 1] = V + 2, -1
    for params in ([SamplingParams()] * 2, [SamplingParams(temperature=1.0)] * 2):
        for mode_q in (q, None):
            for _ in range(20):
                acc, final = native_chain(
                    logits, ids, torch.tensor([3, 3]), mode_q, torch.rand(B, K + 1), params, V
                )
                assert int(acc[0]) == 0 and int(acc[1]) <= 1
                assert bool((final >= 0).all()) and bool((final < V).all())


def test_a_residual_without_mass_falls_back_to_p():
    """p one-hot on id z and q equal to it: a rejection (of an id p gives 0) leaves max(0, p - q)
    without mass, and the token is drawn from p, as verify_rules._normalised_or does."""
    V, z = 300, 17
    logits = torch.full((1, 2, V), float("-inf"))
    logits[0, :, z] = 1.0
    q = torch.zeros(1, 1, V)
    q[0, 0, z] = 1.0
    for u in (0.0, 0.5, 0.999):
        acc, final = native_chain(
            logits, torch.tensor([[V + 5]]), torch.tensor([1]), q, torch.tensor([[u, u]]),
            [SamplingParams(temperature=1.0)], V,
        )  # fmt: skip
        assert (int(acc), int(final)) == (0, z)


def test_a_low_temperature_keeps_near_ties_apart():
    """T 1e-5 (the least) on logits near 30: the kernel scales x - max (exact in fp32 for near
    values), as the tensor path does, not x itself (x / T ~ 3e6, where fp32's step is 0.25: p of
    a runner-up 2 ulps below the leader would be off by ~13 %, and acceptance with it)."""
    V, K = 2000, 2
    g = torch.Generator().manual_seed(6)
    logits = 30.0 + torch.randn(1, K + 1, V, generator=g) * 0.05
    top = logits.amax(-1)  # [1, K+1]
    for _ in range(2):  # the leader 2 ulps above the runner-up: ~0.38 apart after scaling
        top = torch.nextafter(top, torch.full_like(top, 100.0))
    logits[..., 7] = top
    ids = logits[0, :K].topk(2, dim=-1).indices[:, 1][None]  # [1, K] each row's runner-up
    params = [SamplingParams(temperature=1e-5)]
    p = process_logits_batch(logits, params, V)
    q = torch.softmax(torch.randn(1, K, V, generator=g), -1)
    q[0, torch.arange(K), ids[0]] = 19.0  # q(x) ~0.95: u * q(x) crosses p(x) ~0.41
    q = q / q.sum(-1, keepdim=True)
    same = 0
    for _ in range(400):
        u = torch.rand(1, K + 1, generator=g)
        acc, final = native_chain(logits, ids, torch.tensor([K]), q, u, params, V)
        ref = verify_chain(ids, q, p, u, torch.tensor([K]))
        same += int(
            int(acc) == int(ref.num_accepted) and int(final) == int(ref.emitted_ids[0, ref.num_accepted])
        )
    assert same >= 398


def test_a_request_verifies_alike_beside_a_top_p_neighbour():
    """A mixed batch: the plain-temperature rows go through the kernel and the top-p row through
    the tensor path, so each plain row's verdict is the one it gets alone."""
    from specdecode.verify import verify_step

    class Stream:
        def __init__(self, seed):
            self.generator = torch.Generator().manual_seed(seed)

        def sample_uniforms(self, start, n):
            return torch.rand(n, generator=self.generator)

    B, K, V = 3, 3, 3000
    logits, q, ids, _ = _case(B, K, V, seed=8)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.8), SamplingParams()]
    prop = Proposal(ids, torch.tensor([3, 2, 3]), q)
    for trial in range(20):
        both = verify_step(prop, logits, params, [Stream(trial * 3 + b) for b in range(B)], [0] * B, V)
        for b in range(B):
            one = Proposal(ids[b : b + 1], prop.num_draft[b : b + 1], q[b : b + 1])
            alone = verify_step(one, logits[b : b + 1], params[b : b + 1], [Stream(trial * 3 + b)], [0], V)
            assert alone[0] == both[b]


def test_duplicate_draft_vocabulary_ids_are_refused():
    logits, _, ids, _ = _case(1, 2, 100)
    q = torch.softmax(torch.randn(1, 2, 4), -1)
    with pytest.raises(RuntimeError, match="twice"):
        kernels.fused().verify_chain(
            logits,
            ids,
            torch.tensor([2]),
            q,
            torch.rand(1, 3),
            torch.ones(1),
            100,
            torch.tensor([3, 9, 3, 5]),
        )


# ---- trees of point-mass candidates at T > 0 (verify_tree) ------------------------------------------
TREE_PARENTS = [-1, -1, -1, 0, 0, 1, 3, 3, 6]  # siblings at the root and below, 4 levels


def _tree_case(B, V, seed, scale=3.0):
    """Logits and trees whose nodes are often the row's likely tokens: rows with fewer nodes, a
    duplicate sibling, an id past the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    N = len(TREE_PARENTS)
    logits = torch.randn(B, N + 1, V + 4, generator=g) * scale
    logits[..., V:] = 60.0  # padded head rows: never chosen
    top = logits[..., :V].topk(3, dim=-1).indices  # [B, N+1, 3]
    pick = torch.randint(0, 3, (B, N), generator=g)
    par = torch.tensor(TREE_PARENTS)
    ids = top[torch.arange(B)[:, None], par[None] + 1, pick]  # a node: one of its parent row's top 3
    ids[0, 1] = ids[0, 0]  # a duplicate sibling: p' = 0 once the first was rejected
    ids[1, 2] = V + 1  # past the vocabulary: p = 0
    n = torch.tensor([N, N, 5, 0][:B])
    ids = torch.where(torch.arange(N)[None] < n[:, None], ids, -1)
    return logits, ids, par[None].expand(B, -1).clone(), g


def test_tree_verdicts_are_the_tensor_paths_for_the_same_uniforms():
    from specdecode.verify import verify_tree_batch

    B, V = 4, 3000
    logits, ids, par, g = _tree_case(B, V, seed=11)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.6, 2.0, 1.0)]
    p = process_logits_batch(logits, params, V)
    same = total = accepted = 0
    for _ in range(400):
        u = torch.rand(B, len(TREE_PARENTS) + 1, generator=g)
        path, final = native_tree(logits, ids, par, u, params, V)
        ref = verify_tree_batch(par, ids, None, p, u, iid=False)
        for b in range(B):
            a = int(ref.num_accepted[b])
            want = ref.accepted_nodes[b, :a].tolist(), int(ref.emitted_ids[b, a])
            got = [i for i in path[b].tolist() if i >= 0], int(final[b])
            same += got == want
            total += 1
            accepted += a
            assert 0 <= got[1] < V
    assert accepted > 100
    assert same >= total - 2, f"{total - same} of {total} verdicts differ from the tensor path"


def test_a_tree_verdict_does_not_depend_on_the_batch_or_the_threads():
    B, V = 3, 20000
    logits, ids, par, g = _tree_case(B, V, seed=12)
    params = [SamplingParams(temperature=1.0)] * B
    u = torch.rand(B, len(TREE_PARENTS) + 1, generator=g)
    path, final = native_tree(logits, ids, par, u, params, V)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            p1, f1 = native_tree(logits, ids, par, u, params, V)
            assert torch.equal(path, p1) and torch.equal(final, f1)
    finally:
        torch.set_num_threads(threads)
    for b in range(B):
        one = slice(b, b + 1)
        p1, f1 = native_tree(logits[one], ids[one], par[one], u[one], params[:1], V)
        assert torch.equal(p1[0], path[b]) and int(f1) == int(final[b])


def test_tree_verification_goes_to_the_kernel_only_where_it_applies():
    logits, ids, par, _ = _tree_case(2, 100, seed=13)
    u = torch.rand(2, len(TREE_PARENTS) + 1)
    assert native_tree(logits, ids, par, u, [SamplingParams(temperature=1.0)] * 2, 100) is not None
    assert native_tree(logits, ids, par, u, [SamplingParams(temperature=1.0, top_k=5)] * 2, 100) is None
    assert native_tree(logits, ids, par, u, [SamplingParams(), SamplingParams(temperature=1.0)], 100) is None
    bad = par.clone()
    bad[0, 3] = 5  # a parent after its child
    with pytest.raises(RuntimeError, match="parents"):
        kernels.fused().verify_tree(logits, ids, bad, u, torch.ones(2), 100)


def test_a_tree_request_verifies_alike_beside_greedy_and_top_k_neighbours():
    """verify_step on a batch of trees: the plain-temperature rows on the kernel, a top-k row on
    the tensor path, a greedy row on the greedy path; each row's verdict is the one it gets alone."""
    from specdecode.verify import verify_step

    class Stream:
        def __init__(self, seed):
            self.generator = torch.Generator().manual_seed(seed)

        def sample_uniforms(self, start, n):
            return torch.rand(n, generator=self.generator)

    B, V = 3, 3000
    logits, ids, par, _ = _tree_case(B, V, seed=14)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=20), SamplingParams()]
    n = len(TREE_PARENTS)
    prop = Proposal(ids.clamp_min(0), torch.tensor([n, n, 5]), parents=par)
    for trial in range(20):
        both = verify_step(prop, logits, params, [Stream(trial * 3 + b) for b in range(B)], [0] * B, V)
        for b in range(B):
            one = Proposal(prop.draft_ids[b : b + 1], prop.num_draft[b : b + 1], parents=par[b : b + 1])
            alone = verify_step(one, logits[b : b + 1], params[b : b + 1], [Stream(trial * 3 + b)], [0], V)
            assert alone[0] == both[b]


def test_block_never_keeps_a_draft_the_target_excludes_even_at_a_zero_uniform():
    """p(x_1) = 0 makes every later weight 0; uniforms of exactly 0 keep nothing on either path."""
    logits, q, ids, _ = _case(1, 3, 200, seed=11)
    logits[0, 0, ids[0, 0]] = float("-inf")  # the target excludes the first draft
    params = [SamplingParams(temperature=1.0)]
    u = torch.zeros(1, 4)
    p = process_logits_batch(logits, params, 200)
    ref = verify_chain_block(ids, q, p, u, torch.tensor([3]))
    acc, final = native_chain(logits, ids, torch.tensor([3]), q, u, params, 200, block=True)
    assert int(ref.num_accepted[0]) == int(acc[0]) == 0
    assert int(final[0]) != int(ids[0, 0]) and float(p[0, 0, final[0]]) > 0
