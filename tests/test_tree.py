"""Tests for specdecode.tree: hand-built masks and depths, brute-force ancestors, static trees."""

from __future__ import annotations

import pytest
import torch

from specdecode.tree import (
    DraftTree,
    chain_parents,
    children_lists,
    join_by_score,
    tree_attention_mask,
    tree_depths,
    tree_from_paths,
    validate_parents,
)

# root ─┬─ n0 (row 1) ─┬─ n2 (row 3) ── n5 (row 6)
#       │              └─ n3 (row 4)
#       └─ n1 (row 2) ─── n4 (row 5)
PARENTS = [-1, -1, 0, 0, 1, 2]


def test_mask_and_depths_hand_built():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0, 0],  # n0
            [1, 0, 1, 0, 0, 0, 0],  # n1
            [1, 1, 0, 1, 0, 0, 0],  # n2: root, n0
            [1, 1, 0, 0, 1, 0, 0],  # n3: root, n0
            [1, 0, 1, 0, 0, 1, 0],  # n4: root, n1
            [1, 1, 0, 1, 0, 0, 1],  # n5: root, n0, n2
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_attention_mask(torch.tensor(PARENTS)), expected)
    assert torch.equal(tree_attention_mask(PARENTS), expected)
    assert tree_depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert children_lists(PARENTS) == [[0, 1], [2, 3], [4], [5], [], [], []]


def test_chain_is_causal():
    parents = chain_parents(4)
    assert parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(tree_attention_mask(parents), torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree_depths(parents).tolist() == [0, 1, 2, 3, 4]
    assert chain_parents(0).numel() == 0
    assert torch.equal(tree_attention_mask(chain_parents(0)), torch.ones(1, 1, dtype=torch.bool))


def test_mask_matches_brute_force_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for n in [1, 5, 17, 40]:
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i > 0 else -1 for i in range(n)]
        mask = tree_attention_mask(parents)
        depths = tree_depths(parents)
        for i in range(n):
            anc, c, d = {0, i + 1}, parents[i], 1
            while c != -1:
                anc.add(c + 1)
                c, d = parents[c], d + 1
            assert set(mask[i + 1].nonzero().flatten().tolist()) == anc
            assert int(depths[i + 1]) == d


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([-1, 1], r"parents\[1\] = 1"),  # self-parent
        ([-1, 2, 0], r"parents\[1\] = 2"),  # parent after child
        ([-1, -2], r"parents\[1\] = -2"),
        ([0], r"parents\[0\] = 0"),
    ],
)
def test_validate_parents_errors(parents, message):
    with pytest.raises(ValueError, match=message):
        validate_parents(parents)
    with pytest.raises(ValueError, match=message):
        tree_attention_mask(parents)


def test_validate_parents_shape_and_dtype():
    with pytest.raises(ValueError, match="1-D"):
        validate_parents(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        validate_parents(torch.tensor([-1.0, 0.0]))
    validate_parents(PARENTS)
    validate_parents([])


def test_tree_from_paths_medusa_style():
    paths = [[0, 0], [1], [0], [0, 1], [0, 0, 0], [1, 0], [2]]
    tree = tree_from_paths(paths)
    assert tree.paths == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tree.parents.tolist() == [-1, -1, -1, 0, 0, 1, 3]
    assert tree.depths.tolist() == [1, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 1, 2, 0, 1, 0, 0]
    assert tree_depths(tree.parents)[1:].tolist() == tree.depths.tolist()


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([[0], [0, 1, 0]], r"needs its parent path \[0, 1\]"),
        ([[0], [0]], "more than once"),
        ([[0], []], "non-empty"),
        ([[-1]], "ranks >= 0"),
    ],
)
def test_tree_from_paths_errors(paths, message):
    with pytest.raises(ValueError, match=message):
        tree_from_paths(paths)


def test_draft_tree_record():
    tree = DraftTree(tokens=torch.tensor([5, 6, 7]), parents=torch.tensor([-1, 0, 0]))
    assert tree.num_nodes == 3


def test_join_by_score_merges_best_first_and_shares_equal_nodes():
    # Tree: a(-0.1) -> b(-0.5) -> c(-2.0); a -> d(-0.9); e(-1.2) off the root. Chain [a, x, y] at
    # -0.4 a token: a is shared, x (-0.8) joins between b and d, y (-1.2) ties e at a deeper level.
    tokens, parents = [1, 2, 3, 4, 5], [-1, 0, 1, 0, -1]
    scores, depths = [-0.1, -0.5, -2.0, -0.9, -1.2], [1, 2, 3, 2, 1]
    toks, pars = join_by_score(range(5), tokens, parents, scores, depths, [1, 8, 9], -0.4, budget=6)
    assert toks == [1, 2, 8, 4, 5, 9]  # a, b, x, d, e (shallower at the tie), y; c did not fit
    assert pars == [-1, 0, 0, 0, -1, 2]
    # Only the nodes asked for join; a node whose parent is left out is dropped.
    toks, pars = join_by_score([0, 2, 3], tokens, parents, scores, depths, [], 0.0, budget=6)
    assert (toks, pars) == ([1, 4], [-1, 0])
