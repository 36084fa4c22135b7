"""One verify step of the loop: each request's uniforms, the greedy paths, chains and trees.

Contract: `verify_step(proposal, logits, params, streams, positions, vocab_size, mode)` returns
one `Verdict` per request (emitted ids, kept verify-block rows, drafts verified, depth), lossless
in every branch: the rules are `verify_rules` (chains of sampled drafts by block verification,
mode "block", the default, or token-wise rejection, mode "rejection"; point-mass chains and mode
"match" by sample-then-match; recursive rejection over trees; the uniform layout is described
there), which this module feeds
with the target's processed distributions and each request's randomness (`step_uniforms`: a
request consumes the same randomness whatever its neighbours drafted). Greedy rows never build
distributions (`verify_greedy`, `verify_tree_greedy`: the exact T = 0 limit, argmax only).
Chains of greedy or plain-temperature requests go to our CPU kernel where it applies
(`verify_native`: the same verdicts without vocabulary-sized tensors; greedy ones identical), the
rest to the tensor path; a batch that mixes both is split, so a request's verdict does not
depend on its neighbours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.config import SamplingParams
from specdecode.drafter import Proposal
from specdecode.sampling import process_logits_batch
from specdecode.verify_native import argmax_ids, native_chain, native_rows, native_tree, native_tree_rows
from specdecode.verify_rules import (
    ChainVerdict,
    TreeBatchVerdict,
    TreeVerdict,
    verify_chain,
    verify_chain_block,
    verify_chain_match,
    verify_tree,
    verify_tree_batch,
)

__all__ = [
    "Verdict",
    "verify_step",
    "verify_greedy",
    "verify_tree_greedy",
    "step_uniforms",
    # the rules, re-exported for the loop's callers
    "ChainVerdict",
    "TreeVerdict",
    "TreeBatchVerdict",
    "verify_chain",
    "verify_chain_block",
    "verify_chain_match",
    "verify_tree",
    "verify_tree_batch",
]


@dataclass(frozen=True)
class Verdict:
    """One request's outcome of a verify step."""

    emitted_ids: list[int]  # accepted drafts, then the recovered or bonus token
    kept_rows: list[int]  # verify-block rows whose cache entries stay: 0, then the accepted nodes' rows
    num_draft: int  # drafts verified (chain length or tree nodes)
    depth: int  # draft positions on the deepest path (a chain: num_draft)

    @property
    def num_accepted(self) -> int:
        return len(self.emitted_ids) - 1

    @property
    def accepted_nodes(self) -> list[int]:
        """Draft indices on the accepted path (a chain: 0..num_accepted-1)."""
        return [r - 1 for r in self.kept_rows[1:]]


class RandomStream(Protocol):
    """A request's randomness (request.RunningRequest): a generator for per-step uniforms and a
    table of uniforms keyed by output position, for sampling the target's own token there."""

    generator: torch.Generator

    def sample_uniforms(self, start: int, n: int) -> torch.Tensor: ...  # [n]


def step_uniforms(
    streams: Sequence[RandomStream],
    positions: Sequence[int],  # output position of each row's first emitted token
    num_draft: Sequence[int],
    k: int,
    layout: str,  # "match", "chain" or "tree"
) -> torch.Tensor:  # [B, K+1]
    """The uniforms of one step, laid out as the verifier reads them (module docstring).

    match: column j samples the target's token at output position t0 + j (keyed by position).
    chain: n + 1 uniforms from the request's generator; column j decides draft j, column K
    samples the recovered / bonus token. tree: n + 1 from the generator; column i + 1 decides
    node i, column 0 samples the final token. A row without drafts samples position t0 from the
    keyed table whatever the layout, exactly as plain decoding does, so a request consumes the
    same randomness whatever its neighbours drafted.
    """
    uniforms = torch.zeros(len(streams), k + 1)
    for b, (s, t0, n) in enumerate(zip(streams, positions, num_draft, strict=True)):
        if layout == "match":
            uniforms[b, : n + 1] = s.sample_uniforms(t0, n + 1)
        elif n == 0:
            uniforms[b, 0 if layout == "tree" else k] = s.sample_uniforms(t0, 1)[0]
        else:
            u = torch.rand(n + 1, generator=s.generator)
            uniforms[b, : n + 1] = u
            if layout == "chain":
                uniforms[b, k] = u[n]
    return uniforms


def verify_greedy(
    draft_ids: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K+1, V']
    num_draft: torch.Tensor,  # [B] long
    vocab_size: int | None = None,  # ids past it are never chosen (None: all V')
) -> ChainVerdict:
    """T = 0: the exact limit of rejection sampling without building one-hot distributions
    (accept while draft == argmax; the argmax after the last accepted draft is emitted)."""
    target_ids = argmax_ids(target_logits, vocab_size).cpu()  # [B, K+1]
    k = draft_ids.shape[1]
    valid = torch.arange(k)[None] < num_draft.cpu()[:, None]  # [B, K]
    match = (draft_ids.cpu() == target_ids[:, :k]) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    emitted = torch.where(torch.arange(k + 1)[None] <= num_accepted[:, None], target_ids, -1)
    return ChainVerdict(num_accepted=num_accepted, emitted_ids=emitted, num_emitted=num_accepted + 1)


def verify_tree_greedy(
    parents: torch.Tensor,  # [B, N] long, -1 = root (a row's shape)
    tree_ids: torch.Tensor,  # [B, N] long: node tokens; -1 = node absent in this row
    target_logits: torch.Tensor,  # [B, N+1, V'] the target's logits at the block rows (row 0 = root)
    vocab_size: int | None = None,  # ids past it are never chosen (None: all V')
) -> list[tuple[list[int], list[int], int]]:
    """T = 0: the exact limit of `verify_tree_batch` without one-hot distributions. From the
    root, move to the first child (index order) whose token is the target's argmax at the
    current node, while there is one; then emit the argmax there. Per row: (emitted ids, kept
    block rows, depth of the row's deepest node)."""
    target_ids = argmax_ids(target_logits, vocab_size).tolist()  # [B, N+1]
    out = []
    for par, ids, want in zip(parents.tolist(), tree_ids.tolist(), target_ids, strict=True):
        cur, kept, emitted = 0, [0], []
        for i, (pa, x) in enumerate(zip(par, ids, strict=True)):
            if x >= 0 and pa + 1 == cur and x == want[cur]:
                emitted.append(x)
                kept.append(i + 1)
                cur = i + 1
        out.append((emitted + [want[cur]], kept, _deepest(par, ids)))
    return out


def _deepest(parents: list[int], ids: list[int]) -> int:
    """Depth of a row's deepest node (ids of -1: no node), as verify_tree_batch counts it."""
    depth = [0] * (len(ids) + 1)
    for i, (pa, x) in enumerate(zip(parents, ids, strict=True)):
        if x >= 0:
            depth[i + 1] = depth[pa + 1] + 1
    return max(depth)


def verify_step(
    proposal: Proposal,
    logits: torch.Tensor,  # [B, K+1, V'] the target's logits at the verify block (V' >= vocab_size)
    params: Sequence[SamplingParams],
    streams: Sequence[RandomStream],
    positions: Sequence[int],  # output position of each row's first emitted token
    vocab_size: int,
    mode: str = "block",  # chains with q: "block" verification, token-wise "rejection", or "match"
) -> list[Verdict]:
    """Verify one step's proposal for every row: greedy when every row is greedy, else a chain by
    block verification (mode "block") or token-wise rejection sampling (mode "rejection"),
    sample-then-match for point-mass drafts or mode "match", or recursive rejection over a batch
    of trees. Lossless in every branch."""
    num_draft = proposal.num_draft.cpu()  # [B]
    nd = num_draft.tolist()
    k = proposal.max_k
    tree_ids = None  # [B, N] node tokens, -1 past each row's nodes
    if proposal.parents is not None:
        tree_ids = torch.where(torch.arange(k)[None] < num_draft[:, None], proposal.draft_ids.cpu(), -1)
    if all(p.greedy for p in params):
        if tree_ids is None:
            return _chain_verdicts(verify_greedy(proposal.draft_ids, logits, num_draft, vocab_size), nd)
        parents = proposal.parents.cpu().expand(len(nd), -1)  # [B, N] (a shared shape broadcasts)
        rows = verify_tree_greedy(parents, tree_ids, logits, vocab_size)
        return [Verdict(e, kept, nd[b], depth) for b, (e, kept, depth) in enumerate(rows)]
    keyed = mode == "match" or proposal.draft_probs is None
    u = None  # the step's uniforms once drawn (a kernel that declines leaves them to the tensor path)
    if tree_ids is not None and not proposal.tree_iid:  # point-mass candidates: the kernel where it applies
        fast = native_tree_rows(params, vocab_size, logits)
        if 0 < len(fast) < len(nd):  # a mixed batch: each part down its own path, in row order
            return _split_verdicts(fast, proposal, logits, params, streams, positions, vocab_size, mode)
        if fast:
            parents = proposal.parents.cpu().expand(len(nd), -1)  # [B, N]
            u = step_uniforms(streams, positions, nd, k, "tree")
            got = native_tree(logits, tree_ids, parents, u, params, vocab_size)
            if got is not None:
                return _tree_verdicts(parents, tree_ids, *got, nd)
    block = mode == "block" and not keyed and tree_ids is None
    if tree_ids is None:  # a chain: our CPU kernel where it applies (verify_native)
        fast = native_rows(params, vocab_size, logits, proposal.draft_probs)
        if 0 < len(fast) < len(nd):  # a mixed batch: each part down its own path, in row order
            return _split_verdicts(fast, proposal, logits, params, streams, positions, vocab_size, mode)
        u = step_uniforms(streams, positions, nd, k, "match" if keyed else "chain")
        q = None if keyed else proposal.draft_probs
        got = native_chain(
            logits, proposal.draft_ids, num_draft, q, u, params, vocab_size, proposal.draft_vocab, block
        )
        if got is not None:
            return _native_verdicts(proposal.draft_ids.cpu(), *got, nd)
    target_probs = process_logits_batch(logits, list(params), vocab_size)  # [B, K+1, V]
    dev = target_probs.device
    q = proposal.dense_probs(logits.shape[-1])  # [B, K, V] or None
    q = None if q is None else q.to(dev)
    if tree_ids is not None:
        u = (step_uniforms(streams, positions, nd, k, "tree") if u is None else u).to(dev)
        v = verify_tree_batch(proposal.parents, tree_ids.to(dev), q, target_probs, u, proposal.tree_iid)
        kept = v.kept_rows.tolist()
        emitted, depth = v.emitted_ids.tolist(), v.depth.tolist()
        return [
            Verdict(emitted[b][: a + 1], kept[b][: a + 1], nd[b], depth[b])
            for b, a in enumerate(v.num_accepted.tolist())
        ]
    u = u.to(dev)  # the chain's uniforms, drawn above
    draft_ids = proposal.draft_ids.to(dev)
    if block:
        v = verify_chain_block(draft_ids, q, target_probs, u, num_draft.to(dev))
    elif keyed:
        v = verify_chain_match(draft_ids, target_probs, u, num_draft.to(dev))
    else:
        v = verify_chain(draft_ids, q, target_probs, u, num_draft.to(dev))
    return _chain_verdicts(v, nd)


def _split_verdicts(fast: list[int], proposal: Proposal, logits, params, streams, positions, *how):
    """verify_step on the rows our kernel covers and on the others (`how`: vocab_size, mode), each
    request with its own randomness as in one call (its stream's uniforms, laid out at the same K)."""
    out: list[Verdict | None] = [None] * len(params)
    covered = set(fast)
    for rows in (fast, [b for b in range(len(params)) if b not in covered]):
        idx = torch.tensor(rows)

        def take(t, idx=idx):
            return None if t is None else t[idx.to(t.device)]

        parents = proposal.parents
        sub = dataclasses.replace(
            proposal,
            draft_ids=take(proposal.draft_ids),
            num_draft=take(proposal.num_draft),
            draft_probs=take(proposal.draft_probs),
            parents=take(parents) if parents is not None and parents.dim() == 2 else parents,
        )
        pick = [(params[b], streams[b], positions[b]) for b in rows]
        part = verify_step(sub, take(logits), *map(list, zip(*pick, strict=True)), *how)
        for b, v in zip(rows, part, strict=True):
            out[b] = v
    return out


def _native_verdicts(
    draft_ids: torch.Tensor, num_accepted: torch.Tensor, final_ids: torch.Tensor, num_draft: list[int]
) -> list[Verdict]:
    ids, acc, fin = draft_ids.tolist(), num_accepted.tolist(), final_ids.tolist()
    return [
        Verdict(ids[b][:a] + [fin[b]], list(range(a + 1)), num_draft[b], num_draft[b])
        for b, a in enumerate(acc)
    ]


def _tree_verdicts(
    parents: torch.Tensor,
    tree_ids: torch.Tensor,
    path: torch.Tensor,
    final_ids: torch.Tensor,
    num_draft: list[int],
) -> list[Verdict]:
    """Verdicts from the kernel's accepted paths (nodes, then -1) and final tokens."""
    out = []
    for par, ids, nodes, fin, n in zip(
        parents.tolist(), tree_ids.tolist(), path.tolist(), final_ids.tolist(), num_draft, strict=True
    ):
        nodes = [i for i in nodes if i >= 0]
        emitted, kept = [ids[i] for i in nodes] + [fin], [0] + [i + 1 for i in nodes]
        out.append(Verdict(emitted, kept, n, _deepest(par, ids)))
    return out


def _chain_verdicts(v: ChainVerdict, num_draft: list[int]) -> list[Verdict]:
    emitted = v.emitted_ids.tolist()
    return [
        Verdict(emitted[b][: a + 1], list(range(a + 1)), num_draft[b], num_draft[b])
        for b, a in enumerate(v.num_accepted.tolist())
    ]
