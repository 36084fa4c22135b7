"""KVCache bookkeeping: commit, compaction by kept rows, rollback by not committing, overflow."""

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.kv_cache import KVCache


def _cache(num_slots=3, max_len=10):
    return KVCache(num_layers=2, num_slots=num_slots, max_len=max_len, num_kv_heads=2, head_dim=4,
                   dtype=torch.float32)  # fmt: skip


def _fill(cache, slot, start, n):
    """Write recognisable rows: value = 100 * layer + row (both k and v)."""
    for layer in range(cache.num_layers):
        rows = torch.arange(start, start + n, dtype=torch.float32) + 100 * layer
        cache.k[layer][slot, :, start : start + n] = rows[None, :, None]
        cache.v[layer][slot, :, start : start + n] = -rows[None, :, None]


def test_shapes_and_helpers():
    c = _cache()
    assert c.k[0].shape == (3, 2, 11, 4)  # max_len + 1: the scratch row for padded writes
    assert c.lengths == [0, 0, 0] and c.free(1) == 10 and c.used(1) == 0
    c.commit(1, 4)
    assert c.used(1) == 4 and c.free(1) == 6 and c.free_slots() == [0, 2]
    c.reset(1)
    assert c.used(1) == 0 and c.supports_speculation


def test_commit_prefix_keeps_rows_in_place():
    c = _cache()
    _fill(c, 0, 0, 5)
    c.commit(0, 2)
    _fill(c, 0, 2, 3)
    c.commit(0, 2, kept_rows=[0, 1])  # a prefix: nothing moves
    assert c.lengths[0] == 4
    assert c.k[1][0, 0, :4, 0].tolist() == [100, 101, 102, 103]


def test_commit_with_kept_rows_compacts_every_layer():
    c = _cache()
    _fill(c, 2, 0, 8)
    c.commit(2, 3)  # rows 0..2 committed; block written at rows 3..7
    c.commit(2, 3, kept_rows=[0, 2, 4])  # keep block rows 0, 2, 4 -> absolute rows 3, 5, 7
    assert c.lengths[2] == 6
    for layer in range(2):
        got = c.k[layer][2, 1, :6, 0] - 100 * layer
        assert got.tolist() == [0, 1, 2, 3, 5, 7]
        assert (c.v[layer][2, 0, :6, 0] + 100 * layer).tolist() == [0, -1, -2, -3, -5, -7]
    assert c.k[0][1].abs().sum() == 0  # other slots untouched


def test_rollback_is_not_committing():
    c = _cache()
    _fill(c, 0, 0, 6)
    c.commit(0, 3)
    _fill(c, 0, 3, 4)  # a rejected block
    assert c.lengths[0] == 3  # stale rows 3.. are simply overwritten by the next write


def test_overflow_raises_before_writing():
    c = _cache(max_len=10)
    c.commit(0, 8)
    c.check_room([0], [2])
    with pytest.raises(SpecDecodeError, match="exceeds the cache/context length 10; lower"):
        c.check_room([0], [3])
    with pytest.raises(SpecDecodeError):
        c.commit(0, 3)
    with pytest.raises(SpecDecodeError, match="slot 5 does not exist"):
        c.check_room([5], [1])


def test_bad_kept_rows():
    c = _cache()
    with pytest.raises(ValueError):
        c.commit(0, 2, kept_rows=[2, 1])
    with pytest.raises(ValueError):
        c.commit(0, 2, kept_rows=[0])
    c.commit(0, 2, kept_rows=torch.tensor([1, 3]))  # tensors are accepted
    assert c.lengths[0] == 2
