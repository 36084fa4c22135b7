"""Slot-indexed KV cache written by position; rollback is simply not committing.

Contract:
* `CacheState` keeps the committed length of each slot on the host (`lengths: list[int]`), so
  planning a step never reads the device. `commit(slot, num_kept, kept_rows=None)` advances a
  slot by `num_kept` rows of the block written by the last forward; with `kept_rows` (ascending
  block-row indices, e.g. an accepted tree path) rows `lengths + kept_rows[j]` are first copied
  to `lengths + j`. Rows past `lengths` are stale and are overwritten by the next forward.
* `KVCache` preallocates one buffer `kv [2, num_layers, num_slots, Hk, max_len + 1, D]`;
  `k[layer]` / `v[layer]` are views `[num_slots, Hk, max_len + 1, D]`. Row `max_len` is a
  scratch row that absorbs the writes of right-padding tokens in ragged batches; it is never
  attended to. One buffer lets a compaction move the rows of every layer with two tensor ops.
* A write that would pass `max_len` raises `SpecDecodeError` before anything is written.
* `copy_prefix(src, dst, n)` (KVCache) fills an empty slot with the first `n` committed rows of
  another and commits them: requests whose prompts share a prefix compute its rows once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.host_memory import huge_page_empty


class CacheState:
    """Committed lengths per slot and the commit/reset/room bookkeeping shared by all caches."""

    supports_speculation = True  # rows past `lengths` may be rewritten; commit can compact

    def __init__(self, num_slots: int, max_len: int) -> None:
        if num_slots < 1 or max_len < 1:
            raise SpecDecodeError(
                f"a cache needs num_slots >= 1 and max_len >= 1 (got {num_slots}, {max_len})"
            )
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths: list[int] = [0] * num_slots

    # -- queries -------------------------------------------------------------------------------
    def used(self, slot: int) -> int:
        """Committed rows of `slot`."""
        return self.lengths[slot]

    def free(self, slot: int) -> int:
        """Rows `slot` can still take."""
        return self.max_len - self.lengths[slot]

    def free_slots(self) -> list[int]:
        """Slots holding nothing (length 0)."""
        return [s for s, n in enumerate(self.lengths) if n == 0]

    def check_room(self, slots: Sequence[int], num_new: Sequence[int]) -> None:
        """Raise before a write of `num_new[b]` rows to `slots[b]` would pass `max_len`."""
        for s, n in zip(slots, num_new, strict=True):
            if not 0 <= s < self.num_slots:
                raise SpecDecodeError(f"cache slot {s} does not exist (the cache has {self.num_slots} slots)")
            if self.lengths[s] + n > self.max_len:
                raise SpecDecodeError(
                    f"prompt + max_new_tokens exceeds the cache/context length {self.max_len}; lower "
                    f"max_new_tokens or shorten the prompt (slot {s} holds {self.lengths[s]} tokens and "
                    f"{n} more were to be written)"
                )

    # -- updates -------------------------------------------------------------------------------
    def commit(self, slot: int, num_kept: int, kept_rows: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep `num_kept` rows of the block written at `lengths[slot]` by the last forward."""
        start = self.lengths[slot]
        if num_kept < 0 or start + num_kept > self.max_len:
            raise SpecDecodeError(
                f"cannot commit {num_kept} rows to slot {slot}: it holds {start} of {self.max_len} rows"
            )
        if kept_rows is not None:
            rows = [
                int(r) for r in (kept_rows.tolist() if isinstance(kept_rows, torch.Tensor) else kept_rows)
            ]
            if len(rows) != num_kept:
                raise ValueError(f"kept_rows has {len(rows)} entries but num_kept is {num_kept}")
            if any(b <= a for a, b in zip(rows, rows[1:], strict=False)) or (rows and rows[0] < 0):
                raise ValueError(f"kept_rows must be ascending block-row indices, got {rows}")
            if rows != list(range(num_kept)):  # a prefix is already in place
                if start + rows[-1] >= self.max_len:
                    raise ValueError(f"kept row {rows[-1]} lies past the cache end ({self.max_len})")
                self._compact(slot, start, rows)
        self.lengths[slot] = start + num_kept

    def reset(self, slot: int) -> None:
        """Forget everything in `slot` (its rows become stale)."""
        self.lengths[slot] = 0

    def _compact(self, slot: int, start: int, rows: list[int]) -> None:
        raise NotImplementedError


class KVCache(CacheState):
    """Preallocated K/V for `num_slots` requests of up to `max_len` tokens (see module docstring)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_slots, max_len)
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeros, not empty: masked rows still enter SDPA's products and must be finite. On the CPU
        # in huge pages where the OS allows (a batched step reads every slot's rows).
        shape = (2, num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        if self.device.type == "cpu":
            self.kv = huge_page_empty(shape, dtype).zero_()  # [2, layers, S, Hk, max_len + 1, D]
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k = list(self.kv[0].unbind(0))  # layer -> [S, Hk, max_len + 1, D]
        self.v = list(self.kv[1].unbind(0))

    @property
    def scratch_row(self) -> int:
        """Row index that takes padded writes; never attended."""
        return self.max_len

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` committed rows of slot `src` into the empty slot `dst` and commit them."""
        if src == dst or not 0 < n <= self.lengths[src] or self.lengths[dst] != 0:
            raise ValueError(
                f"copy_prefix needs an empty destination and n in 1..{self.lengths[src]} committed rows "
                f"of the source (src {src}, dst {dst} holding {self.lengths[dst]}, n {n})"
            )
        self.kv[:, :, dst, :, :n].copy_(self.kv[:, :, src, :, :n])  # [2, layers, Hk, n, D]
        self.lengths[dst] = n

    def _compact(self, slot: int, start: int, rows: list[int]) -> None:
        # Gather first (a copy), then write: source and destination rows may overlap.
        idx = torch.tensor(rows, device=self.device) + start  # [n]
        block = self.kv[:, :, slot]  # [2, layers, Hk, max_len + 1, D] view
        kept = block.index_select(3, idx)  # [2, layers, Hk, n, D]
        block[:, :, :, start : start + len(rows)].copy_(kept)
