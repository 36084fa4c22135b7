"""Prompt lookup (n-gram) drafting: no model, free to run.

Contract: for each request, find the most recent earlier occurrence of the context's last n
tokens (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it, up to
K. Deterministic, so drafts are point masses. Strong on summarisation, code edits and RAG,
where the output copies spans of the prompt.
`ngram-tree` (`NgramDrafter(tree=True)`): the continuations of several earlier matches at once,
merged into a token tree of at most K nodes (`lookup_tree`: longest n first, the most recent
match first, each continuation up to `TREE_DEPTH` tokens, shared prefixes stored once); one
verify pass checks every branch and keeps the longest accepted path. Still point masses.
`ngram-table` (`NgramDrafter(table=NgramTable)`, its own registry record and checkpoint kind):
when the context holds no match of n >= 2 tokens, the table's walk drafts instead: an n-gram
model of the target's own regenerated answers (the most frequent next token after each frequent
context of 4, 3 or 2 tokens), built by `specdecode train ngram-table` (training/ngram_table.py).
Still deterministic point masses: the output distribution stays the target's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from specdecode.drafter import Drafter, DraftRow, Method, Proposal
from specdecode.drafters.checkpoint import load_checkpoint
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


TABLE_ORDERS = (4, 3, 2)  # context lengths an n-gram table keys on, longest first
MIN_SHARE = 0.1  # a context whose best next token has a smaller share of its count is a stop


def context_keys(windows: np.ndarray) -> np.ndarray:
    """[M, n] token ids -> [M] uint64 keys (a polynomial hash, wrapping; a collision only makes
    a worse guess: drafts are verified)."""
    h = np.full(len(windows), windows.shape[1], dtype=np.uint64)
    for j in range(windows.shape[1]):
        h = h * np.uint64(0x100000001B3) + windows[:, j].astype(np.uint64)
    return h


class NgramTable:
    """The most likely next token after each frequent n-token context of a corpus (the target's
    own regenerated answers): an n-gram model that drafts by a greedy walk, longest context first.

    `build(seqs, orders, min_count, min_share)` counts, for every order n, each context's next
    tokens and keeps contexts seen at least `min_count` times; a context whose most frequent next
    token has less than `min_share` of its count is kept as a stop (the walk ends there rather
    than guessing from a shorter context). `draft(context, k)` walks up to k tokens.
    `state()` / `from_state(tensors)`: the table as drafter checkpoint tensors.
    """

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        self.tables = tables  # n -> (sorted uint64 keys [M], next token [M] int32, -1: stop)
        self.orders = tuple(sorted(tables, reverse=True))

    @classmethod
    def build(cls, seqs, orders=TABLE_ORDERS, min_count: int = 4, min_share: float = MIN_SHARE) -> NgramTable:
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
            order = np.lexsort((-count, pk))  # per context, the most frequent next token first
            pk, px, count = pk[order], px[order], count[order]
            first = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
            total = np.add.reduceat(count, first)
            keep = total >= min_count
            best = np.where(count[first] >= min_share * total, px[first], -1)
            tables[n] = (pk[first][keep], best[keep].astype(np.int32))
        return cls(tables)

    def next_token(self, context: np.ndarray) -> int | None:
        for n in self.orders:
            if len(context) < n:
                continue
            keys, nxt = self.tables[n]
            key = context_keys(context[None, -n:])[0]
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                return None if nxt[i] < 0 else int(nxt[i])
        return None

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

    @property
    def size(self) -> int:
        return sum(len(k) for k, _ in self.tables.values())

    def state(self) -> dict[str, torch.Tensor]:
        """The table as checkpoint tensors: `keys{n}` (the uint64 keys' bits as int64), `next{n}`."""
        out = {}
        for n, (k, x) in self.tables.items():
            out[f"keys{n}"] = torch.from_numpy(k.view(np.int64).copy())
            out[f"next{n}"] = torch.from_numpy(x.astype(np.int32))
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> NgramTable:
        orders = sorted(int(name[4:]) for name in state if name.startswith("keys"))
        keys = {n: state[f"keys{n}"].numpy().view(np.uint64) for n in orders}
        return cls({n: (keys[n], state[f"next{n}"].numpy()) for n in orders})


def table_continuation(
    tokens: np.ndarray, k: int, table: NgramTable, min_ngram: int, max_ngram: int
) -> np.ndarray:
    """Prompt lookup backed by a table: a match of n >= 2 tokens in the context first, else the
    table's walk, else a single-token match (a lone token repeats by chance more often than a
    frequent context of the target's answers predicts)."""
    c = lookup_continuation(tokens, k, max(2, min_ngram), max_ngram)
    if len(c) == 0:
        c = table.draft(tokens, k)
    if len(c) == 0 and min_ngram < 2:
        c = lookup_continuation(tokens, k, min_ngram, 1)
    return c


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
    ):
        if not (1 <= min_ngram <= max_ngram):
            raise SpecDecodeError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        if tree and table is not None:
            raise SpecDecodeError("ngram-tree drafts from the context only; a table serves ngram-table")
        self.min_ngram, self.max_ngram, self.max_context = min_ngram, max_ngram, max_context
        self.tree, self.table = tree, table
        if table is not None:
            self.name = "ngram-table"

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
                conts.append(lookup_continuation(ctx, k, self.min_ngram, self.max_ngram))
            else:
                conts.append(table_continuation(ctx, k, self.table, self.min_ngram, self.max_ngram))
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


def _load_table(variant, target, spec, **kw) -> NgramDrafter:
    _, state = load_checkpoint(spec, "ngram-table", target)  # another target's table is refused
    return NgramDrafter(table=NgramTable.from_state(state))


TABLE_METHOD = Method(
    name="ngram-table",
    variants={"ngram-table": 8},
    load=_load_table,
    checkpoint="ngram-table",
    summary="prompt lookup backed by an n-gram table of the target's own regenerated answers "
    "(`specdecode train ngram-table`): no network, free to run",
)
