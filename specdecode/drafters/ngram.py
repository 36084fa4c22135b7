"""Prompt lookup (n-gram) drafting: no model, free to run.

Contract: for each request, find the most recent earlier occurrence of the context's last n
tokens (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it, up to
K. Deterministic, so drafts are point masses. Strong on summarisation, code edits and RAG,
where the output copies spans of the prompt.
`ngram-tree` (`NgramDrafter(tree=True)`): the continuations of several earlier matches at once,
merged into a token tree of at most K nodes (`lookup_tree`: longest n first, the most recent
match first, each continuation up to `TREE_DEPTH` tokens, shared prefixes stored once); one
verify pass checks every branch and keeps the longest accepted path. Still point masses.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from specdecode.drafter import Drafter, DraftRow, Method, Proposal
from specdecode.errors import SpecDecodeError


def match_starts(tokens: np.ndarray, min_ngram: int, max_ngram: int) -> Iterator[int]:
    """Where the continuations of the earlier matches of the trailing n-gram start: longest n
    first, the most recent match first (lazily: a shorter n is searched only when asked)."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        pattern = tokens[n_tok - n :]
        # Windows that start at i and end before the trailing n-gram itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)  # [n_tok-n, n]
        for hit in np.nonzero((windows == pattern).all(axis=1))[0][::-1].tolist():
            yield hit + n  # the token after the match


def lookup_continuation(tokens: np.ndarray, k: int, min_ngram: int, max_ngram: int) -> np.ndarray:
    """Tokens that followed the latest earlier match of the trailing n-gram; longest n first."""
    start = next(match_starts(tokens, min_ngram, max_ngram), None)
    return tokens[:0] if start is None else tokens[start : start + k]


TREE_DEPTH = 8  # tokens of each match's continuation a tree holds at most


def lookup_tree(
    tokens: np.ndarray, budget: int, min_ngram: int, max_ngram: int, depth: int = TREE_DEPTH
) -> tuple[list[int], list[int]]:
    """(token, parent) per node of a tree of at most `budget` nodes, parents first (-1: the last
    context token): the continuations of the earlier matches of the trailing n-gram, longest n
    first, most recent match first, each continuation inserted along the tree's shared prefix."""
    toks: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    seen: set[int] = set()  # continuation starts already inserted (a shorter n finds them again)
    for start in match_starts(tokens, min_ngram, max_ngram):
        if start in seen:
            continue
        seen.add(start)
        node = -1
        for t in tokens[start : start + depth].tolist():
            nxt = children.get((node, t))
            if nxt is None:
                if len(toks) == budget:
                    return toks, parents
                nxt = children[(node, t)] = len(toks)
                toks.append(t)
                parents.append(node)
            node = nxt
    return toks, parents


class NgramDrafter(Drafter):
    name = "ngram"
    cost_per_token = 0.0
    deterministic = True

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, max_context: int = 4096, tree: bool = False):
        if not (1 <= min_ngram <= max_ngram):
            raise SpecDecodeError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.min_ngram, self.max_ngram, self.max_context = min_ngram, max_ngram, max_context
        self.tree = tree

    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        if self.tree:
            return self._propose_tree(batch, num_draft)
        conts = []
        for row, k in zip(batch, num_draft, strict=True):
            if k <= 0:
                conts.append(np.zeros(0, dtype=np.int64))
                continue
            ctx = np.asarray(row.token_ids[-self.max_context :], dtype=np.int64)
            conts.append(lookup_continuation(ctx, k, self.min_ngram, self.max_ngram))
        max_k = max((len(c) for c in conts), default=0)
        draft_ids = torch.zeros(len(batch), max_k, dtype=torch.long)  # [B, K]
        for b, c in enumerate(conts):
            draft_ids[b, : len(c)] = torch.from_numpy(c)
        num_draft_t = torch.tensor([len(c) for c in conts], dtype=torch.long)
        return Proposal(draft_ids=draft_ids, num_draft=num_draft_t, draft_probs=None)

    def _propose_tree(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        trees = [
            lookup_tree(np.asarray(row.token_ids[-self.max_context :], dtype=np.int64), k, self.min_ngram,
                        self.max_ngram) if k > 0 else ([], [])
            for row, k in zip(batch, num_draft, strict=True)
        ]  # fmt: skip
        width = max((len(t) for t, _ in trees), default=0)
        draft_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, W]
        parents = torch.full((len(batch), width), -1, dtype=torch.long)  # [B, W]
        for b, (toks, pars) in enumerate(trees):
            draft_ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            parents[b, : len(pars)] = torch.tensor(pars, dtype=torch.long)
        num = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
        return Proposal(draft_ids=draft_ids, num_draft=num, parents=parents, tree_iid=False)


METHOD = Method(
    name="ngram",
    variants={"ngram": 6, "ngram-tree": 16},
    load=lambda variant, target, spec, **kw: NgramDrafter(tree=variant == "ngram-tree"),
    needs_drafter=False,
    summary="prompt lookup: no model, drafts the continuation of the latest matching n-gram "
    "(ngram-tree: of several matches, as one tree)",
)
