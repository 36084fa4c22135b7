"""Prompt lookup (n-gram) drafting: no model, free to run.

Contract: for each request, find the most recent earlier occurrence of the context's last n
tokens (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it, up to
K, and up to `SHORT_MATCH_DRAFTS[n]` after a match of only n tokens (`short_match_drafts`; {}
drafts K after any match). Deterministic, so drafts are point masses. Strong on summarisation,
code edits and RAG, where the output copies spans of the prompt.
`ngram-tree` (`NgramDrafter(tree=True)`): the continuations of several earlier matches at once,
merged into a token tree of at most K nodes (`lookup_tree`: longest n first, the most recent
match first, each continuation up to `TREE_DEPTH` tokens, shared prefixes stored once); one
verify pass checks every branch and keeps the longest accepted path. Still point masses.
`ngram-table` (`NgramDrafter(table=NgramTable)`, its own registry record and checkpoint kind):
when the context holds no match of n >= 2 tokens, the table's walk drafts instead: an n-gram
model of the target's own regenerated answers (the most frequent next tokens after each frequent
context of 4, 3 or 2 tokens, with their shares), built by `specdecode train ngram-table`
(training/ngram_table.py); the context's matches are capped as `ngram`'s, the table's walk is
not. `ngram-table-tree` (`NgramDrafter(table=..., tree=True)`): the
context's match and the table's continuations in one tree of at most K nodes (`table_tree`), the
table's nodes best first by the product of shares along their path (`NgramTable.grow`, as an
EAGLE-2 tree ranks by its drafter's probabilities). Still deterministic point masses: the output
distribution stays the target's.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

import numpy as np
import torch

from specdecode.drafter import Drafter, DraftRow, Method, Proposal
from specdecode.drafters.checkpoint import load_checkpoint
from specdecode.errors import SpecDecodeError
from specdecode.tree import TokenTree


def match_starts(tokens: np.ndarray, min_ngram: int, max_ngram: int) -> Iterator[int]:
    """Where the continuations of the earlier matches of the trailing n-gram start: longest n
    first, the most recent match first (lazily: a shorter n is searched only when asked)."""
    return (start for _, start in _matches(tokens, min_ngram, max_ngram))


def _matches(tokens: np.ndarray, min_ngram: int, max_ngram: int) -> Iterator[tuple[int, int]]:
    """`match_starts` with each match's length: (n, start)."""
    n_tok = len(tokens)
    if n_tok < 2:
        return
    # A match of n tokens lies before the context's last token (it ends at e <= n_tok - 2) and
    # ends at e >= n - 1, on a copy of the last token: only those ends are checked.
    ends = np.flatnonzero(tokens[: n_tok - 1] == tokens[-1])  # [M] ascending
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        e = ends[ends >= n - 1]
        ok = np.ones(len(e), dtype=bool)
        for j in range(1, n):
            ok &= tokens[e - j] == tokens[n_tok - 1 - j]
        for hit in e[ok][::-1].tolist():
            yield n, hit + 1  # the token after the match


def lookup_continuation(
    tokens: np.ndarray, k: int, min_ngram: int, max_ngram: int, caps: dict[int, int] | None = None
) -> np.ndarray:
    """Tokens that followed the latest earlier match of the trailing n-gram; longest n first; at
    most caps[n] of them after a match of n tokens (`caps` None or without n: k)."""
    first = next(_matches(tokens, min_ngram, max_ngram), None)
    if first is None:
        return tokens[:0]
    n, start = first
    return tokens[start : start + min(k, (caps or {}).get(n, k))]


# Most drafts a short match proposes (n -> tokens): on SmolLM2's answers a 1-token match's first
# token is right 15-23 % of the time and a 2-token match's 37-41 %, against 72-87 % for 3 tokens
# (benchmarks/results/ngram-ceiling-smollm2-135m-epyc-zen3): K drafts after them spend verify
# time on tokens that are rarely accepted.
SHORT_MATCH_DRAFTS = {1: 1, 2: 2}


TREE_DEPTH = 8  # tokens of each match's continuation a tree holds at most

# A learned drafter's lookup tree (eagle-, dspark-, dflash-tree-lookup) takes prompt lookup's
# branch: the continuation of the latest earlier match of the context's trailing n-gram, n the
# longest key here; its j-th token scores j * LOOKUP_LOGP[n] beside the tree's log-probabilities
# (p 0.7 and 0.4 a token: the best of the values in benchmarks/results/served-tau-eagle-lookup.md).
LOOKUP_LOGP = {3: -0.36, 2: -0.92}


def lookup_prefix(tokens, budget: int) -> tuple[np.ndarray | None, float]:
    """(the continuation, up to min(`budget`, TREE_DEPTH) tokens, of the latest match of the
    context's trailing n-gram, the longest n in LOOKUP_LOGP first; its per-token score
    LOOKUP_LOGP[n]), or (None, 0) without one. `tokens`: the context's ids (any sequence)."""
    ctx, depth = np.asarray(tokens, dtype=np.int64), min(budget, TREE_DEPTH)
    for n in sorted(LOOKUP_LOGP, reverse=True):
        cont = lookup_continuation(ctx, depth, n, n)
        if len(cont):
            return cont, LOOKUP_LOGP[n]
    return None, 0.0


def lookup_tree(
    tokens: np.ndarray, budget: int, min_ngram: int, max_ngram: int, depth: int = TREE_DEPTH
) -> tuple[list[int], list[int]]:
    """(token, parent) per node of a tree of at most `budget` nodes, parents first (-1: the last
    context token): the continuations of the earlier matches of the trailing n-gram, longest n
    first, most recent match first, each continuation inserted along the tree's shared prefix."""
    tree = TokenTree(budget)
    seen: set[int] = set()  # continuation starts already inserted (a shorter n finds them again)
    for start in match_starts(tokens, min_ngram, max_ngram):
        if start in seen:
            continue
        seen.add(start)
        if not tree.insert(tokens[start : start + depth]):
            break
    return tree.tokens, tree.parents


TABLE_ORDERS = (4, 3, 2)  # context lengths an n-gram table keys on, longest first
MIN_SHARE = 0.1  # a context whose best next token has a smaller share of its count is a stop
TABLE_WIDTH = 2  # next tokens a table keeps per context: the best and the tree's alternative
MIN_PATH = 0.05  # a table tree's node needs this product of shares along its path
NO_TOKEN = np.iinfo(np.uint16).max  # the empty slot of a row stored as uint16


def context_keys(windows: np.ndarray) -> np.ndarray:
    """[M, n] token ids -> [M] uint64 keys (a polynomial hash, wrapping; a collision only makes
    a worse guess: drafts are verified)."""
    h = np.full(len(windows), windows.shape[1], dtype=np.uint64)
    for j in range(windows.shape[1]):
        h = h * np.uint64(0x100000001B3) + windows[:, j].astype(np.uint64)
    return h


def quantize_shares(share: np.ndarray) -> np.ndarray:
    """Shares in (0, 1] -> uint8 steps of 1/255, the nearest (a seen token never reads 0)."""
    return np.maximum(np.round(share * 255.0), 1).astype(np.uint8)


class NgramTable:
    """The likeliest next tokens after each frequent n-token context of a corpus (the target's own
    regenerated answers): an n-gram model that drafts a greedy walk or a tree, longest context
    first.

    `build(seqs, orders, min_count, min_share, width)` counts, for every order n, each context's
    next tokens and keeps contexts seen at least `min_count` times, each with its `width` most
    frequent next tokens and their shares of the count (steps of 1/255). `candidates(context)`:
    those of the longest known context. `draft(context, k)` walks up to k tokens, each the best
    next token; a context whose best token has under `min_share` is a stop (the walk ends there
    rather than guessing from a shorter context). `grow(tree, context, min_path)` adds nodes best
    first by the product of shares along their path, down to `min_path`.
    `state()` / `from_state(tensors, min_share)`: the table as drafter checkpoint tensors.
    """

    def __init__(
        self, tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], min_share: float = MIN_SHARE
    ):
        # n -> (sorted uint64 keys [M], next tokens [M, W] int64 (-1: none), shares [M, W] float32)
        self.tables = tables
        self.orders = tuple(sorted(tables, reverse=True))
        self.min_share = min_share

    @classmethod
    def build(
        cls,
        seqs,
        orders=TABLE_ORDERS,
        min_count: int = 4,
        min_share: float = MIN_SHARE,
        width: int = TABLE_WIDTH,
    ) -> NgramTable:
        seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
        tables = {}
        for n in orders:
            keys, nxt = [], []
            for a in seqs:
                if len(a) > n:
                    w = np.lib.stride_tricks.sliding_window_view(a, n + 1)  # [len - n, n + 1]
                    keys.append(context_keys(w[:, :n]))
                    nxt.append(w[:, n])
            if not keys:
                continue
            k, x = np.concatenate(keys), np.concatenate(nxt)
            order = np.lexsort((x, k))
            k, x = k[order], x[order]
            pair = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (x[1:] != x[:-1])])  # first of each pair
            count = np.diff(np.r_[pair, len(k)])
            pk, px = k[pair], x[pair]
            order = np.lexsort((px, -count, pk))  # per context, the most frequent next token first
            pk, px, count = pk[order], px[order], count[order]
            first = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])  # [M]
            end = np.r_[first[1:], len(pk)]
            total = np.add.reduceat(count, first)
            keep = total >= min_count
            top = np.full((len(first), width), -1, dtype=np.int64)  # [M, W]
            share = np.zeros((len(first), width), dtype=np.float32)  # [M, W]
            for j in range(width):
                has = first + j < end
                top[has, j] = px[first[has] + j]
                share[has, j] = quantize_shares(count[first[has] + j] / total[has]) / np.float32(255.0)
            tables[n] = (pk[first][keep], top[keep], share[keep])
        return cls(tables, min_share)

    def candidates(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(next tokens [W], shares [W]) of the longest context the table knows, or None."""
        for n in self.orders:
            if len(context) < n:
                continue
            keys, top, share = self.tables[n]
            key = context_keys(np.asarray(context[-n:], dtype=np.int64)[None])[0]
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                return top[i], share[i]
        return None

    def next_token(self, context: np.ndarray) -> int | None:
        got = self.candidates(context)
        if got is None or got[0][0] < 0 or got[1][0] < self.min_share:
            return None
        return int(got[0][0])

    def draft(self, context: np.ndarray, k: int) -> np.ndarray:
        """Up to k tokens, each the table's next token after the context so far."""
        longest = max(self.orders, default=1)
        ctx = list(context[-longest:])
        out: list[int] = []
        while len(out) < k:
            t = self.next_token(np.asarray(ctx, dtype=np.int64))
            if t is None:
                break
            out.append(t)
            ctx = (ctx + [t])[-longest:]  # a short context grows into the longer orders
        return np.asarray(out, dtype=np.int64)

    def grow(self, tree: TokenTree, context: np.ndarray, min_path: float = MIN_PATH) -> None:
        """Add the table's continuations of `context` to `tree` best first by the product of
        shares along each path (a path's product never grows, so parents come first; ties in
        the order they were found; a node already in the tree is shared and grown from), until
        the tree is full or no candidate's path reaches `min_path`."""
        longest = max(self.orders, default=1)
        found = itertools.count()
        heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (-path, found, parent, token, ctx)

        def push(path: float, parent: int, ctx: tuple[int, ...]) -> None:
            got = self.candidates(np.asarray(ctx, dtype=np.int64))
            for t, share in zip(*(got or ((), ())), strict=True):
                if t < 0 or path * share < min_path:
                    break  # shares fall along the row
                heapq.heappush(heap, (-path * float(share), next(found), parent, int(t), ctx))

        push(1.0, -1, tuple(int(t) for t in context[-longest:]))
        while heap:
            neg_path, _, parent, t, ctx = heapq.heappop(heap)
            node = tree.add(parent, t)
            if node is None:
                return
            push(-neg_path, node, (*ctx, t)[-longest:])

    @property
    def size(self) -> int:
        return sum(len(k) for k, _, _ in self.tables.values())

    def state(self) -> dict[str, torch.Tensor]:
        """The table as checkpoint tensors: `keys{n}` (the uint64 keys' bits as int64), `next{n}`
        [M, W] (uint16 bits as int16, NO_TOKEN empty, where every id fits; else int32, -1 empty),
        `share{n}` [M, W] uint8 (steps of 1/255)."""
        out = {}
        for n, (k, top, share) in self.tables.items():
            out[f"keys{n}"] = torch.from_numpy(k.view(np.int64).copy())
            if top.max(initial=-1) < NO_TOKEN:
                out[f"next{n}"] = torch.from_numpy(
                    np.where(top < 0, NO_TOKEN, top).astype(np.uint16).view(np.int16)
                )
            else:
                out[f"next{n}"] = torch.from_numpy(top.astype(np.int32))
            out[f"share{n}"] = torch.from_numpy(np.round(share * 255.0).astype(np.uint8))
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], min_share: float = MIN_SHARE) -> NgramTable:
        """Also reads the first format: `next{n}` [M] int32, the best token only, -1 a stop."""
        tables = {}
        for n in sorted(int(name[4:]) for name in state if name.startswith("keys")):
            keys = state[f"keys{n}"].numpy().view(np.uint64)
            nxt = state[f"next{n}"].numpy()
            if nxt.ndim == 1:  # the first format: a stop has no token, a kept token a full share
                top = nxt.astype(np.int64)[:, None]
                share = (top >= 0).astype(np.float32)
            else:
                if nxt.dtype == np.int16:
                    top = nxt.view(np.uint16).astype(np.int64)
                    top[top == NO_TOKEN] = -1
                else:
                    top = nxt.astype(np.int64)
                share = state[f"share{n}"].numpy().astype(np.float32) / np.float32(255.0)
            tables[n] = (keys, top, share)
        return cls(tables, min_share)


def table_continuation(
    tokens: np.ndarray,
    k: int,
    table: NgramTable,
    min_ngram: int,
    max_ngram: int,
    caps: dict[int, int] | None = None,
) -> np.ndarray:
    """Prompt lookup backed by a table: a match of n >= 2 tokens in the context first, else the
    table's walk, else a single-token match (a lone token repeats by chance more often than a
    frequent context of the target's answers predicts); the context's matches cut to caps[n]
    tokens (`lookup_continuation`'s caps), the table's walk never."""
    c = lookup_continuation(tokens, k, max(2, min_ngram), max_ngram, caps)
    if len(c) == 0:
        c = table.draft(tokens, k)
    if len(c) == 0 and min_ngram < 2:
        c = lookup_continuation(tokens, k, min_ngram, 1, caps)
    return c


def table_tree(
    tokens: np.ndarray,
    budget: int,
    table: NgramTable,
    min_ngram: int,
    max_ngram: int,
    min_path: float = MIN_PATH,
) -> tuple[list[int], list[int]]:
    """(token, parent) per node, parents first, of a tree of at most `budget` nodes: the context's
    latest match of n >= 2 tokens (its continuation, up to TREE_DEPTH), then the table's
    continuations best first (`NgramTable.grow`), else a single-token match's continuation."""
    tree = TokenTree(budget)
    tree.insert(lookup_continuation(tokens, min(budget, TREE_DEPTH), max(2, min_ngram), max_ngram))
    table.grow(tree, tokens, min_path)
    if not tree.tokens and min_ngram < 2:
        tree.insert(lookup_continuation(tokens, min(budget, TREE_DEPTH), min_ngram, 1))
    return tree.tokens, tree.parents


class NgramDrafter(Drafter):
    name = "ngram"
    cost_per_token = 0.0
    deterministic = True

    def __init__(
        self,
        min_ngram: int = 1,
        max_ngram: int = 3,
        max_context: int = 4096,
        tree: bool = False,
        table: NgramTable | None = None,
        short_match_drafts: dict[int, int] | None = None,
    ):
        if not (1 <= min_ngram <= max_ngram):
            raise SpecDecodeError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.min_ngram, self.max_ngram, self.max_context = min_ngram, max_ngram, max_context
        self.tree, self.table = tree, table
        # prompt lookup's chains: the drafts a short match may propose (None: SHORT_MATCH_DRAFTS,
        # {}: no cap, every match up to K)
        self.caps = dict(SHORT_MATCH_DRAFTS if short_match_drafts is None else short_match_drafts)
        if table is not None:
            self.name = "ngram-table-tree" if tree else "ngram-table"

    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        if self.tree:
            return self._propose_tree(batch, num_draft)
        conts = []
        for row, k in zip(batch, num_draft, strict=True):
            if k <= 0:
                conts.append(np.zeros(0, dtype=np.int64))
                continue
            ctx = np.asarray(row.token_ids[-self.max_context :], dtype=np.int64)
            if self.table is None:
                conts.append(lookup_continuation(ctx, k, self.min_ngram, self.max_ngram, self.caps))
            else:
                conts.append(
                    table_continuation(ctx, k, self.table, self.min_ngram, self.max_ngram, self.caps)
                )
        max_k = max((len(c) for c in conts), default=0)
        draft_ids = torch.zeros(len(batch), max_k, dtype=torch.long)  # [B, K]
        for b, c in enumerate(conts):
            draft_ids[b, : len(c)] = torch.from_numpy(c)
        num_draft_t = torch.tensor([len(c) for c in conts], dtype=torch.long)
        return Proposal(draft_ids=draft_ids, num_draft=num_draft_t, draft_probs=None)

    def _propose_tree(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        ctxs = [np.asarray(row.token_ids[-self.max_context :], dtype=np.int64) for row in batch]
        trees = [self._tree(c, k) if k > 0 else ([], []) for c, k in zip(ctxs, num_draft, strict=True)]
        width = max((len(t) for t, _ in trees), default=0)
        draft_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, W]
        parents = torch.full((len(batch), width), -1, dtype=torch.long)  # [B, W]
        for b, (toks, pars) in enumerate(trees):
            draft_ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            parents[b, : len(pars)] = torch.tensor(pars, dtype=torch.long)
        num = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
        return Proposal(draft_ids=draft_ids, num_draft=num, parents=parents, tree_iid=False)

    def _tree(self, ctx: np.ndarray, budget: int) -> tuple[list[int], list[int]]:
        if self.table is None:
            return lookup_tree(ctx, budget, self.min_ngram, self.max_ngram)
        return table_tree(ctx, budget, self.table, self.min_ngram, self.max_ngram)


METHOD = Method(
    name="ngram",
    variants={"ngram": 6, "ngram-tree": 16},
    load=lambda variant, target, spec, **kw: NgramDrafter(tree=variant == "ngram-tree"),
    needs_drafter=False,
    summary="prompt lookup: no model, drafts the continuation of the latest matching n-gram "
    "(ngram-tree: of several matches, as one tree)",
)


def _load_table(variant, target, spec, **kw) -> NgramDrafter:
    arch, state = load_checkpoint(spec, "ngram-table", target)  # another target's table is refused
    table = NgramTable.from_state(state, arch.get("min_share", MIN_SHARE))
    return NgramDrafter(table=table, tree=variant == "ngram-table-tree")


TABLE_METHOD = Method(
    name="ngram-table",
    variants={"ngram-table": 8, "ngram-table-tree": 8},
    load=_load_table,
    checkpoint="ngram-table",
    summary="prompt lookup backed by an n-gram table of the target's own regenerated answers "
    "(`specdecode train ngram-table`): no network, free to run (ngram-table-tree: the context's "
    "match and the table's likeliest continuations as one tree, best first by their shares)",
)
