"""Draft trees as parent arrays: attention masks, depths, children, static (Medusa-style) trees.

Contract (pure helpers, inputs never mutated): a draft tree of N nodes is a parent array
`parents [N]` (long). Node i is block row i + 1 of the verify block; block row 0 is the root
(the last committed token); `parents[i] == -1` means node i hangs off the root. Parents precede
children (`parents[i] < i`), so index order is a topological order, and verification tries
siblings in index order (put the most likely first). A chain of K drafts is the tree
`chain_parents(K) = [-1, 0, 1, ..., K-2]`.

Position of block row r = committed length + depth[r]; row r attends to the committed context
plus the rows `tree_attention_mask(parents)[r]` marks (itself and its ancestors); `tree_rows`
gives the mask and the depths together.
`TokenTree(budget)` builds such a tree of token ids node by node (shared prefixes stored once),
as the drafters that merge several candidate continuations do; `join_by_score` merges a scored
tree (a learned drafter's) and a chain (prompt lookup's continuation) best first into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DraftTree",
    "TokenTree",
    "join_by_score",
    "StaticTree",
    "validate_parents",
    "chain_parents",
    "tree_attention_mask",
    "tree_depths",
    "children_lists",
    "tree_from_paths",
]


@dataclass(frozen=True)
class DraftTree:
    """One request's draft tree."""

    tokens: torch.Tensor  # [N] long: token of node i (block row i + 1)
    parents: torch.Tensor  # [N] long: parent node of node i, -1 = root

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape given by choice ranks per depth (Medusa's `tree_choices`)."""

    paths: list[tuple[int, ...]]  # node i's path of ranks, sorted by (depth, path)
    parents: torch.Tensor  # [N] long, -1 = root
    depths: torch.Tensor  # [N] long, 1 for the root's children
    ranks: torch.Tensor  # [N] long: node i is the ranks[i]-th candidate at its parent / depth


def _as_parents(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if not isinstance(parents, torch.Tensor):
        parents = torch.tensor(list(parents), dtype=torch.long)
    return parents


def validate_parents(parents: torch.Tensor | Sequence[int]) -> None:  # [N]
    """Raise ValueError unless `parents` is a 1-D integer array with -1 <= parents[i] < i."""
    parents = _as_parents(parents)
    if parents.dim() != 1:
        raise ValueError(f"parents must be 1-D [N], got shape {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor, got dtype {parents.dtype}")
    idx = torch.arange(parents.shape[0], device=parents.device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"parents[{i}] = {int(parents[i])} is invalid: each node's parent must be -1 (the "
            f"root) or an earlier node (0..{i - 1}); order nodes so parents precede children"
        )


def chain_parents(num_nodes: int, device: torch.device | str | None = None) -> torch.Tensor:  # [K]
    """Parents of a chain of `num_nodes` drafts: [-1, 0, 1, ..., K-2]."""
    return torch.arange(-1, num_nodes - 1, dtype=torch.long, device=device)


def tree_rows(parents: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree_attention_mask(parents) [N+1, N+1] bool, tree_depths(parents) [N+1] long) in one
    pass over the (validated) parents: a node's row is its parent's row plus itself."""
    parents = _as_parents(parents)
    validate_parents(parents)
    par = parents.tolist()
    n_rows = len(par) + 1
    mask = np.eye(n_rows, dtype=bool)  # the root sees itself
    depth = [0] * n_rows
    for r, p in enumerate(par, start=1):  # block row r = node r - 1, its parent's row p + 1 < r
        mask[r, :r] = mask[p + 1, :r]
        depth[r] = depth[p + 1] + 1
    return torch.from_numpy(mask).to(parents.device), torch.tensor(depth, device=parents.device)


def tree_attention_mask(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:  # [N+1, N+1] bool
    """mask[r, c] is True iff block row c is row r itself or one of its ancestors (root = row 0)."""
    return tree_rows(parents)[0]


def tree_depths(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:  # [N+1] long
    """Depth of every block row: 0 for the root, 1 for its children, ..."""
    return tree_rows(parents)[1]


def children_lists(parents: torch.Tensor | Sequence[int]) -> list[list[int]]:
    """Entry 0 lists the root's children, entry i + 1 node i's children (node indices, in order)."""
    parents = _as_parents(parents)
    validate_parents(parents)
    out: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, pa in enumerate(parents.tolist()):
        out[pa + 1].append(i)
    return out


def tree_from_paths(paths: Sequence[Sequence[int]]) -> StaticTree:
    """Static tree from rank paths, e.g. [[0], [1], [0, 0], [0, 1]] (Medusa `tree_choices`).

    Path (r_1, ..., r_d) is the node reached by taking the r_1-th candidate at depth 1, then the
    r_2-th at depth 2, ... Nodes are ordered by (depth, path), so parents precede children and
    siblings come in rank order. Every proper prefix of a path must itself be a path.
    """
    norm: list[tuple[int, ...]] = []
    for p in paths:
        t = tuple(int(r) for r in p)
        if not t or any(r < 0 for r in t):
            raise ValueError(f"tree path {list(p)!r} must be a non-empty list of ranks >= 0")
        norm.append(t)
    if len(set(norm)) != len(norm):
        dup = next(t for t in norm if norm.count(t) > 1)
        raise ValueError(f"tree path {list(dup)} appears more than once")
    order = sorted(norm, key=lambda t: (len(t), t))
    index = {t: i for i, t in enumerate(order)}
    parents = []
    for t in order:
        if len(t) == 1:
            parents.append(-1)
        elif t[:-1] in index:
            parents.append(index[t[:-1]])
        else:
            raise ValueError(f"tree path {list(t)} needs its parent path {list(t[:-1])} in the tree too")
    return StaticTree(
        paths=order,
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor([len(t) for t in order], dtype=torch.long),
        ranks=torch.tensor([t[-1] for t in order], dtype=torch.long),
    )


class TokenTree:
    """A token tree of at most `budget` nodes, parents first: `add(parent, token)` returns the
    child (an existing one is shared, -1 is the last context token) or None when the tree is full;
    `insert(tokens)` adds a chain from the root."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(self, parent: int, token: int) -> int | None:
        node = self.children.get((parent, token))
        if node is None:
            if len(self.tokens) == self.budget:
                return None
            node = self.children[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return node

    def insert(self, tokens) -> bool:
        """Add a chain from the root; False when the budget ran out on the way."""
        node = -1
        for t in tokens:
            node = self.add(node, int(t))
            if node is None:
                return False
        return True


def join_by_score(
    nodes: Sequence[int],
    tokens: Sequence[int],
    parents: Sequence[int],
    scores: Sequence[float],
    depths: Sequence[int],
    chain: Sequence[int],
    chain_score: float,
    budget: int,
) -> tuple[list[int], list[int]]:
    """(tokens, parents) of at most `budget` nodes, parents first: the tree nodes `nodes` (indices
    into tokens / parents (-1: the root) / cumulative scores / depths, a node's parent among them
    or the root) and the chain's tokens (the j-th, j from 1, scoring j * `chain_score`) joined
    best first (score, then depth), a node shared where both hold the same token after the same
    parent. A node whose parent did not fit is left out; nothing joins once the budget is spent.
    With scores that never rise along a path, a parent always comes before its children."""
    cands = [(scores[i], depths[i], 0, i) for i in nodes]
    cands += [((j + 1) * chain_score, j + 1, 1, j) for j in range(len(chain))]
    cands.sort(key=lambda c: (-c[0], c[1]))
    tree = TokenTree(budget)
    node_of: dict[tuple[int, int], int] = {}  # (source: 0 tree / 1 chain, index) -> joined node
    for _, _, src, i in cands:
        if src == 0:
            parent, tok = (node_of.get((0, parents[i])) if parents[i] >= 0 else -1), tokens[i]
        else:
            parent, tok = (node_of.get((1, i - 1)) if i > 0 else -1), int(chain[i])
        if parent is None:
            continue  # its parent did not fit
        got = tree.add(parent, tok)
        if got is None:
            break
        node_of[(src, i)] = got
    return tree.tokens, tree.parents
