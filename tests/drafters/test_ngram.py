import numpy as np
import torch

from specdecode.config import SamplingParams
from specdecode.drafter import DraftRow
from specdecode.drafters.ngram import NgramDrafter, lookup_continuation, lookup_tree


def test_lookup_prefers_longest_and_latest_match():
    toks = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3])
    # trailing 3-gram [5,2,3] never occurred before; 2-gram [2,3] occurred at 1 and 5 -> latest (5) wins
    assert lookup_continuation(toks, 3, 1, 3).tolist() == [7, 8, 5]
    assert lookup_continuation(np.array([4, 5, 6]), 3, 1, 3).tolist() == []  # no match at all
    assert lookup_continuation(np.array([1, 2, 1, 2]), 5, 1, 3).tolist() == [1, 2]  # ends at the context


def test_propose_is_ragged_and_point_mass():
    d = NgramDrafter()
    g = torch.Generator()
    rows = [
        DraftRow(0, [1, 2, 3, 4, 1, 2], SamplingParams(), g),
        DraftRow(1, [5, 6, 7], SamplingParams(), g),
    ]
    prop = d.propose(rows, [4, 4])
    assert prop.draft_probs is None
    assert prop.num_draft.tolist() == [4, 0]
    assert prop.draft_ids[0].tolist() == [3, 4, 1, 2]
    assert d.propose(rows, [0, 0]).num_draft.tolist() == [0, 0]


def test_lookup_tree_merges_the_continuations_of_every_match():
    toks = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3])
    # [2, 3] matched at 5 (latest) then 1: [7, 8, 5, 2, 3] and [9, 9, 2, 3, 7, 8, 5, 2] side by side;
    # the 1-gram [3] finds the same two starts again, which add nothing
    toks_, parents = lookup_tree(toks, 16, 1, 3)
    assert toks_ == [7, 8, 5, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2]
    assert parents == [-1, 0, 1, 2, 3, -1, 5, 6, 7, 8, 9, 10, 11]
    assert lookup_tree(toks, 3, 1, 3) == ([7, 8, 5], [-1, 0, 1])  # the budget caps the nodes
    # two matches that share their first token share its node
    toks_, parents = lookup_tree(np.array([4, 1, 5, 6, 4, 1, 5, 7, 0, 4]), 16, 1, 1, depth=3)
    assert toks_ == [1, 5, 7, 6] and parents == [-1, 0, 1, 1]
    assert lookup_tree(np.array([4, 5, 6]), 8, 1, 3) == ([], [])


def test_tree_proposal_is_point_mass_with_parents_first():
    d = NgramDrafter(tree=True)
    g = torch.Generator()
    rows = [
        DraftRow(0, [4, 1, 5, 6, 4, 1, 5, 7, 0, 4], SamplingParams(), g),
        DraftRow(1, [5, 6, 7], SamplingParams(), g),
    ]
    prop = d.propose(rows, [16, 16])
    assert prop.draft_probs is None and not prop.tree_iid
    assert prop.num_draft.tolist() == [11, 0]  # [1, 5, 7, 0, 4] and [6, 4, 1, 5, 7, 0] under 5
    parents = prop.parents[0].tolist()
    assert all(p < i for i, p in enumerate(parents))
