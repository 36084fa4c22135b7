import numpy as np
import torch

from specdecode.config import SamplingParams
from specdecode.drafter import DraftRow
from specdecode.drafters.ngram import NgramDrafter, lookup_continuation


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
