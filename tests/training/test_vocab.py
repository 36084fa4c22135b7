"""The draft vocabulary and its coverage of the response tokens (training/vocab.py)."""

from types import SimpleNamespace

import pytest
import torch

from specdecode.training.vocab import coverage, draft_vocabulary


def seq(ids, mask):
    return SimpleNamespace(input_ids=torch.tensor(ids), loss_mask=torch.tensor(mask))


def test_coverage_of_a_vocabulary_is_the_share_of_response_tokens_it_holds():
    seqs = [seq([5, 1, 1, 2, 3], [0, 1, 1, 1, 1]), seq([5, 1, 4, 9], [0, 0, 1, 1])]
    d2t, cover = draft_vocabulary(seqs, 2, eos_ids=[9], vocab_rows=10)
    assert d2t.tolist() == [1, 9]  # the most frequent response token, EOS always kept
    assert cover == pytest.approx(3 / 6) == coverage(seqs, d2t)
    assert coverage(seqs, torch.tensor([2, 3, 4])) == pytest.approx(3 / 6)
    assert coverage(seqs, torch.tensor([5])) == 0.0  # prompt tokens do not count
