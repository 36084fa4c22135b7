"""Lossless verification rules for draft chains and trees: pure functions over distributions.

Contract: given draft tokens, the processed distributions they were drawn from (q, or None for
point-mass drafts), the target's processed distributions p at every verify-block row, and the
randomness as uniforms in [0, 1), return a verdict whose emitted tokens are distributed exactly
as sampling from p alone (docs/methods.md, "Speculative sampling"). All randomness comes from
`uniforms`, so the same inputs give the same verdict and a test can run 1e5 trials in one call.
p and q must come from `sampling.process_logits` with the request's params; at temperature 0 p
is one-hot and every mode reduces to greedy: accept while the draft equals the argmax, then
emit the argmax. `verify.verify_step` applies them to one step of the loop.

Names (as in vLLM): *accepted* drafts are kept; at the first rejection a *recovered* token is
sampled from the residual norm(max(0, p - q)); when every draft is accepted a *bonus* token is
sampled from the next p; *emitted* = accepted + the recovered or bonus token.

Uniform layout. Chain: `uniforms[:, k]` decides draft k (0-based), `uniforms[:, K]` samples the
recovered / bonus token. Sample-then-match: `uniforms[:, k]` samples the target's token at
block row k. Tree: `uniforms[:, i + 1]` decides node i (block row i + 1), `uniforms[:, 0]`
samples the final token.

Acceptance is tested as `u * q(x) < p(x)`, i.e. u < min(1, p(x) / q(x)) without a division.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.sampling import sample
from specdecode.tree import DraftTree, validate_parents

__all__ = [
    "ChainVerdict",
    "TreeVerdict",
    "TreeBatchVerdict",
    "verify_chain",
    "verify_chain_block",
    "verify_chain_match",
    "verify_tree",
    "verify_tree_batch",
]


@dataclass
class ChainVerdict:
    num_accepted: torch.Tensor  # [B] long: drafts kept
    emitted_ids: torch.Tensor  # [B, K+1] long: accepted drafts, then recovered/bonus, then -1
    num_emitted: torch.Tensor  # [B] long: num_accepted + 1


@dataclass
class TreeVerdict:
    """One request's tree verdict."""

    accepted_nodes: torch.Tensor  # [A] long: node indices on the accepted path, root to leaf
    emitted_ids: torch.Tensor  # [A+1] long: accepted tokens, then the final token
    kept_rows: torch.Tensor  # [A+1] long: block rows whose KV to keep: 0, accepted_nodes + 1
    num_accepted: int  # A


@dataclass
class TreeBatchVerdict:
    """Tree verdicts for a batch of requests sharing one tree shape; D = depth of the tree."""

    num_accepted: torch.Tensor  # [B] long
    accepted_nodes: torch.Tensor  # [B, D] long, -1 after the accepted path
    emitted_ids: torch.Tensor  # [B, D+1] long, -1 after the emitted tokens
    kept_rows: torch.Tensor  # [B, D+1] long, -1 after the kept rows
    num_emitted: torch.Tensor  # [B] long: num_accepted + 1
    depth: torch.Tensor  # [B] long: depth of the row's deepest node (0 = no node)


def _draft_mask(
    num_draft: torch.Tensor | None,  # [B] long or None
    B: int,
    K: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # valid [B, K] bool, num_draft [B] long
    if num_draft is None:
        return torch.ones(B, K, dtype=torch.bool, device=device), torch.full((B,), K, device=device)
    num_draft = num_draft.to(device=device, dtype=torch.long)
    return torch.arange(K, device=device) < num_draft[:, None], num_draft


def _check_shapes(what: str, **shapes: tuple[tuple[int, ...], tuple[int | None, ...]]) -> None:
    """Raise ValueError naming the argument whose shape disagrees (None = any size)."""
    for name, (got, want) in shapes.items():
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=False)):
            legend = tuple("*" if w is None else w for w in want)
            raise ValueError(f"{what}: {name} has shape {tuple(got)}, expected {legend}")


def _normalised_or(
    residual: torch.Tensor,  # [B, V] non-negative
    fallback: torch.Tensor,  # [B, V]
) -> torch.Tensor:  # [B, V]
    """residual / its mass, or `fallback` where the residual has no mass.

    The residual max(0, p - q) is all zero only when p <= q everywhere, i.e. p == q, where a
    rejection has probability 0 and only happens through rounding: p is then the right answer.
    """
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), fallback)


def _chain_inputs(
    what: str,
    draft_ids: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] or None
    target_probs: torch.Tensor,  # [B, K+1, V]
    uniforms: torch.Tensor,  # [B, K+1]
    num_draft: torch.Tensor | None,  # [B] long or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # valid [B, K], num_draft [B], safe_ids [B, K]
    """A chain rule's checked inputs: which draft slots count, and ids gatherable where padded."""
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    _check_shapes(
        what,
        target_probs=(target_probs.shape, (B, K + 1, V)),
        uniforms=(uniforms.shape, (B, K + 1)),
        draft_probs=(draft_probs.shape if draft_probs is not None else (B, K, V), (B, K, V)),
    )
    valid, num_draft = _draft_mask(num_draft, B, K, draft_ids.device)
    return valid, num_draft, torch.where(valid, draft_ids, 0)


def _chain_verdict(
    draft_ids: torch.Tensor,  # [B, K] long
    num_accepted: torch.Tensor,  # [B] long
    final_ids: torch.Tensor,  # [B] long
) -> ChainVerdict:
    """Emitted = accepted drafts, then the recovered / bonus token, then -1 padding."""
    B, K = draft_ids.shape
    pos = torch.arange(K, device=draft_ids.device)
    emitted = torch.full((B, K + 1), -1, dtype=torch.long, device=draft_ids.device)
    emitted[:, :K] = torch.where(pos[None] < num_accepted[:, None], draft_ids, -1)
    emitted.scatter_(1, num_accepted[:, None], final_ids[:, None])
    return ChainVerdict(num_accepted=num_accepted, emitted_ids=emitted, num_emitted=num_accepted + 1)


def verify_chain(
    draft_ids: torch.Tensor,  # [B, K] long (entries at k >= num_draft[b] are ignored)
    draft_probs: torch.Tensor | None,  # [B, K, V] q_k the drafts were drawn from; None = point mass
    target_probs: torch.Tensor,  # [B, K+1, V] p_k at block rows 0..K
    uniforms: torch.Tensor,  # [B, K+1] in [0, 1)
    num_draft: torch.Tensor | None = None,  # [B] long, drafts per row (ragged); None = all K
) -> ChainVerdict:
    """Chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised over B, K.

    Accept x_k w.p. min(1, p_k(x_k) / q_k(x_k)); at the first rejection emit a recovered token
    from norm(max(0, p_k - q_k)); after num_draft[b] acceptances emit a bonus from p_{n+1}.
    Point-mass drafts (q = one-hot at x_k): accept w.p. p_k(x_k), recover from p_k without x_k.
    """
    B, K = draft_ids.shape
    args = (draft_ids, draft_probs, target_probs, uniforms, num_draft)
    valid, num_draft, safe_ids = _chain_inputs("verify_chain", *args)  # safe_ids: padding gatherable
    rows = torch.arange(B, device=draft_ids.device)

    # 1. Acceptance test of every draft at once; keep the prefix before the first rejection.
    p_x = target_probs[:, :K].gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        accept = uniforms[:, :K] < p_x
    else:
        q_x = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]
        accept = uniforms[:, :K] * q_x < p_x
    accept = accept & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    # 2. Distribution of the last emitted token: residual at a rejection, else p (bonus).
    p_last = target_probs[rows, num_accepted]  # [B, V]
    final_probs = p_last
    if K > 0:
        k_last = num_accepted.clamp(max=K - 1)
        if draft_probs is None:
            q_last = torch.zeros_like(p_last).scatter_(1, safe_ids[rows, k_last, None], 1.0)  # [B, V]
        else:
            q_last = draft_probs[rows, k_last].to(p_last.dtype)  # [B, V]
        residual = _normalised_or((p_last - q_last).clamp_min(0), p_last)
        rejected = num_accepted < num_draft  # [B]
        final_probs = torch.where(rejected[:, None], residual, p_last)
    return _chain_verdict(draft_ids, num_accepted, sample(final_probs, uniforms[:, K]))


def verify_chain_block(
    draft_ids: torch.Tensor,  # [B, K] long (entries at k >= num_draft[b] are ignored)
    draft_probs: torch.Tensor | None,  # [B, K, V] q_k the drafts were drawn from; None = point mass
    target_probs: torch.Tensor,  # [B, K+1, V] p_k at block rows 0..K
    uniforms: torch.Tensor,  # [B, K+1] in [0, 1)
    num_draft: torch.Tensor | None = None,  # [B] long, drafts per row (ragged); None = all K
) -> ChainVerdict:
    """Block verification (Sun et al. 2024): the chain judged as a whole, never fewer accepted
    drafts in expectation than `verify_chain`, the same output law.

    With weights w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)) and residual masses
    S_i = sum_x max(0, w_i p_i(x) - q_i(x)), draft i's stop probability is h_i = S_i / (S_i + 1 - w_i)
    (0 where S_i = 0) and h_n = w_n for the last draft. A = the largest i with uniforms[:, i-1] < h_i
    (0 if none) drafts are kept; the final token is the bonus from p_n when A = n, else drawn
    from norm(max(0, w_A p_A - q_A)). Token-wise rejection keeps a prefix only while every
    draft passes on its own; here a later draft that p likes more than q can vouch for an earlier
    one (w carries the surplus), so the first draft of a chain is kept more often.
    """
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    args = (draft_ids, draft_probs, target_probs, uniforms, num_draft)
    valid, num_draft, safe_ids = _chain_inputs("verify_chain_block", *args)
    dev = draft_ids.device
    rows = torch.arange(B, device=dev)
    p = target_probs.double()  # [B, K+1, V]
    if draft_probs is None:
        q = torch.zeros(B, K, V, dtype=p.dtype, device=dev).scatter_(-1, safe_ids[..., None], 1.0)
    else:
        q = draft_probs.to(p.dtype)  # [B, K, V]
    p_x = p[:, :K].gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]
    q_x = q.gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]

    w = torch.ones(B, K + 1, dtype=p.dtype, device=dev)  # [B, K+1] w_i, i = 0..K
    for i in range(1, K + 1):
        px, qx = p_x[:, i - 1], q_x[:, i - 1]  # a draft q gives no mass passes any test: ratio "inf"
        ratio = torch.where(qx > 0, px / qx.clamp_min(1e-300), (px > 0).to(p.dtype) * 1e300)
        w[:, i] = (w[:, i - 1] * ratio).clamp(max=1.0)
    # Residual masses S_i for i = 0..K-1 (q_i is the draft distribution at row i).
    S = (w[:, :K, None] * p[:, :K] - q).clamp_min(0).sum(-1)  # [B, K]
    denom = S + 1 - w[:, :K]
    h = torch.where(S > 0, S / denom.clamp_min(1e-300), 0.0)  # [B, K] h_i, i = 0..K-1
    h = torch.cat([h, torch.zeros(B, 1, dtype=p.dtype, device=dev)], 1)  # [B, K+1]
    h[rows, num_draft] = w[rows, num_draft]  # the last draft: h_n = w_n
    i_range = torch.arange(1, K + 1, device=dev)  # [K] draft i = 1..K
    # strictly below: a uniform of exactly 0 never keeps a draft p gives no mass (h = 0 there)
    stops = (uniforms[:, :K].to(p.dtype) < h[:, 1:]) & (i_range[None] <= num_draft[:, None])  # [B, K]
    num_accepted = torch.where(stops, i_range[None], 0).amax(1) if K > 0 else num_draft * 0  # [B]

    p_last = p[rows, num_accepted]  # [B, V]
    final_probs = p_last
    if K > 0:
        k_last = num_accepted.clamp(max=K - 1)
        w_last = w[rows, num_accepted][:, None]  # [B, 1]
        residual = _normalised_or((w_last * p_last - q[rows, k_last]).clamp_min(0), p_last)
        final_probs = torch.where((num_accepted < num_draft)[:, None], residual, p_last)
    return _chain_verdict(draft_ids, num_accepted, sample(final_probs.to(target_probs.dtype), uniforms[:, K]))


def verify_chain_match(
    draft_ids: torch.Tensor,  # [B, K] long
    target_probs: torch.Tensor,  # [B, K+1, V]
    uniforms: torch.Tensor,  # [B, K+1] in [0, 1)
    num_draft: torch.Tensor | None = None,  # [B] long or None = all K
) -> ChainVerdict:
    """Sample-then-match (DFlash's loop): sample the target's token at every row, keep drafts
    while they equal it, emit the target's sample at the first mismatch (or the bonus).

    Lossless at any temperature, but accepts less than `verify_chain` when T > 0.
    """
    B, K = draft_ids.shape
    _check_shapes(
        "verify_chain_match",
        target_probs=(target_probs.shape, (B, K + 1, None)),
        uniforms=(uniforms.shape, (B, K + 1)),
    )
    dev = draft_ids.device
    valid, _ = _draft_mask(num_draft, B, K, dev)
    sampled = sample(target_probs, uniforms)  # [B, K+1]
    match = (sampled[:, :K] == draft_ids) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    pos = torch.arange(K + 1, device=dev)
    emitted = torch.where(pos[None] <= num_accepted[:, None], sampled, -1)
    return ChainVerdict(num_accepted=num_accepted, emitted_ids=emitted, num_emitted=num_accepted + 1)


def verify_tree_batch(
    parents: torch.Tensor | Sequence[int],  # [N] shared by the batch, or [B, N]; long, -1 = root
    tree_ids: torch.Tensor,  # [B, N] long: node tokens; -1 = node absent in this row
    draft_probs: torch.Tensor | None,  # [B, N, V] q at each node's parent; None if not iid
    target_probs: torch.Tensor,  # [B, N+1, V] p at block rows (row 0 = root)
    uniforms: torch.Tensor,  # [B, N+1] in [0, 1)
    iid: bool,
) -> TreeBatchVerdict:
    """Recursive rejection over siblings (SpecInfer; EAGLE-2), vectorised over the batch.

    Walk from the root; at a node try its children in index order. iid=True (children drawn
    i.i.d. from q): accept child c w.p. min(1, p(c) / q(c)), on rejection p <- norm(max(0, p - q)).
    iid=False (children chosen deterministically, e.g. top-k): point masses; accept w.p. p(c), on
    rejection zero p(c) and renormalise (sampling without replacement). Accepting c moves to c
    with p <- p at c's row. When no child is left, the final token is sampled from the current p.
    Rows may carry trees of different shapes (`parents` [B, N]; absent nodes have id -1).
    """
    B, N = tree_ids.shape
    if isinstance(parents, torch.Tensor) and parents.dim() == 2:
        par_rows = [row.tolist() for row in parents.cpu()]
    else:
        shared = parents.tolist() if isinstance(parents, torch.Tensor) else [int(x) for x in parents]
        par_rows = [shared] * B
    present = (tree_ids >= 0).cpu()  # [B, N]
    for b, par in enumerate(par_rows):
        n = int(present[b].sum()) if B else 0
        if len(par) != N:
            raise ValueError(f"verify_tree: parents has {len(par)} nodes per row, expected {N}")
        validate_parents(par[:n] if n < N and not bool(present[b, n:].any()) else par)
    if iid and draft_probs is None:
        raise ValueError("iid tree verification needs draft_probs (q at each node's parent)")
    V = target_probs.shape[-1]
    _check_shapes(
        "verify_tree",
        target_probs=(target_probs.shape, (B, N + 1, V)),
        uniforms=(uniforms.shape, (B, N + 1)),
        draft_probs=(draft_probs.shape if draft_probs is not None else (B, N, V), (B, N, V)),
    )
    dev = tree_ids.device
    depth_rows = []  # per row: depth of every block row
    for par in par_rows:
        d = [0] * (N + 1)
        for i, pa in enumerate(par):
            d[i + 1] = d[pa + 1] + 1 if pa < i else 0
        depth_rows.append(d)
    depth = torch.tensor(depth_rows, dtype=torch.long, device=dev).reshape(B, N + 1)  # [B, N+1]
    par_t = torch.tensor(par_rows, dtype=torch.long, device=dev).reshape(B, N)  # [B, N]
    D = int(depth.max()) if B else 0
    # On CPU the check "does any row test this node" is free and skips most of a wide tree.
    skip_untested = dev.type == "cpu"

    cur = torch.zeros(B, dtype=torch.long, device=dev)  # [B] block row of the current node
    p = target_probs[:, 0].float()  # [B, V] current target distribution (residual after rejects)
    accepted_nodes = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)  # column D: scratch
    # Index order visits a node's children in order, after the parent and after every earlier
    # sibling; a row tests node i only while its current node is i's parent.
    for i in range(N):
        x = tree_ids[:, i]  # [B]
        tested = (cur == par_t[:, i] + 1) & (x >= 0)
        if skip_untested and not bool(tested.any()):
            continue
        x = x.clamp_min(0)[:, None]  # [B, 1]
        p_x = p.gather(1, x).squeeze(1)  # [B]
        u = uniforms[:, i + 1]
        if iid:
            q = draft_probs[:, i].float()  # [B, V]
            accept = tested & (u * q.gather(1, x).squeeze(1) < p_x)
            residual = (p - q).clamp_min(0)
        else:
            accept = tested & (u < p_x)
            residual = p.scatter(1, x, 0.0)
        reject = tested & ~accept
        p = torch.where(reject[:, None], _normalised_or(residual, p), p)
        p = torch.where(accept[:, None], target_probs[:, i + 1].float(), p)
        cur = torch.where(accept, i + 1, cur)
        col = torch.where(accept, depth[:, i + 1] - 1, D)[:, None]  # [B, 1]
        accepted_nodes.scatter_(1, col, torch.full_like(col, i))
    accepted_nodes = accepted_nodes[:, :D]

    final_ids = sample(p, uniforms[:, 0])  # [B]
    num_accepted = (accepted_nodes >= 0).sum(dim=1)  # [B]
    on_path = accepted_nodes >= 0  # [B, D]
    path_ids = tree_ids.gather(1, accepted_nodes.clamp_min(0)) if N > 0 else accepted_nodes
    emitted = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    emitted[:, :D] = torch.where(on_path, path_ids, -1)
    emitted.scatter_(1, num_accepted[:, None], final_ids[:, None])
    kept_rows = torch.cat(
        [torch.zeros(B, 1, dtype=torch.long, device=dev), torch.where(on_path, accepted_nodes + 1, -1)],
        dim=1,
    )
    return TreeBatchVerdict(
        num_accepted=num_accepted,
        accepted_nodes=accepted_nodes,
        emitted_ids=emitted,
        kept_rows=kept_rows,
        num_emitted=num_accepted + 1,
        depth=(depth * torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev), tree_ids >= 0], 1)).amax(1),
    )


def verify_tree(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [N+1, V] p at block rows (row 0 = root)
    draft_probs: torch.Tensor | None,  # [N, V] q node i was drawn from (q at its parent)
    uniforms: torch.Tensor | torch.Generator,  # [N+1] in [0, 1), or a generator to draw them
    iid: bool,
) -> TreeVerdict:
    """Tree verification for one request (see `verify_tree_batch` for the rule).

    At T = 0 (one-hot p) it returns the path whose tokens equal the target's argmax (the
    longest such path when siblings are distinct), then the argmax after it.
    """
    N = tree.num_nodes
    if isinstance(uniforms, torch.Generator):
        uniforms = torch.rand(N + 1, generator=uniforms, device=uniforms.device)
    v = verify_tree_batch(
        tree.parents,
        tree.tokens[None].to(target_probs.device),
        None if draft_probs is None else draft_probs[None],
        target_probs[None],
        uniforms.to(target_probs.device)[None],
        iid,
    )
    a = int(v.num_accepted[0])
    return TreeVerdict(
        accepted_nodes=v.accepted_nodes[0, :a],
        emitted_ids=v.emitted_ids[0, : a + 1],
        kept_rows=v.kept_rows[0, : a + 1],
        num_accepted=a,
    )
