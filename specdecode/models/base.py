"""The target-runtime interface: `CausalLM`, its `ModelInfo` and its `ForwardOutput`.

Contract (docs/ARCHITECTURE.md, "Target runtime"): a `CausalLM` owns no per-request state. All
request state lives in a cache made by `new_cache(num_slots, max_len)` and indexed by slot.
`forward` writes the new tokens' K/V at rows `cache.lengths[slot] + i` and never changes
`lengths`; the caller keeps rows with `cache.commit(slot, num_kept, kept_rows)`. `prefill` is
the one method that commits (it writes a whole prompt in chunks).

Layer-index convention (the one place it is stated): `capture=(i, ...)` returns the output of
decoder layer `i` (0-based), which is transformers' `hidden_states[i + 1]` for every layer but the
last; transformers replaces its last entry with the final normed state, which is our key `-1`.

Legend: B batch, N new tokens, V vocabulary (head rows, may be padded past the tokenizer),
d hidden size, L cache rows, Hk KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specdecode.errors import SpecDecodeError

# Capture key of the final normed hidden state (the LM head's input).
FINAL_NORM = -1


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a loaded model that drafters and the loop need."""

    arch: str  # HF model_type, e.g. "llama", "qwen2", "gpt2"
    num_layers: int
    hidden_size: int  # d
    vocab_size: int  # V: rows of the LM head (can exceed len(tokenizer))
    max_position: int  # context length from the config
    dtype: torch.dtype
    device: torch.device
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    native: bool = True  # NativeDecoder (True) or HFAdapter (False)
    supports_tree: bool = True  # accepts tree_mask in forward
    max_slots: int | None = None  # None = any number of slots; HFAdapter: 1
    format: str = ""  # weight formats of the matrix products (models/formats.py), "" = dtype only


@dataclass
class ForwardOutput:
    """What one forward returns."""

    logits: torch.Tensor | None  # [B, N, V] fp32; None when forward(..., logits=False)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, N, d], model dtype


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only LM with slot-indexed, rollback-free caching (see module docstring)."""

    info: ModelInfo

    def new_cache(self, num_slots: int, max_len: int): ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, N] long
        positions: torch.Tensor,  # [B, N] long
        cache,
        slots: torch.Tensor | Sequence[int],  # [B]
        num_new: torch.Tensor | Sequence[int] | None = None,  # [B]
        tree_mask: torch.Tensor | None = None,  # [B, N, N] bool
        capture: Sequence[int] = (),
    ) -> ForwardOutput: ...

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, P] long (right-padded when ragged)
        cache,
        slots: torch.Tensor | Sequence[int],  # [B]
        num_new: torch.Tensor | Sequence[int] | None = None,  # [B]
        capture: Sequence[int] = (),
        chunk_size: int = 512,
    ) -> ForwardOutput: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # [..] -> [.., d]

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [.., d] -> [.., V] fp32

    def lm_head_weight(self) -> torch.Tensor: ...  # [V, d] output head (the embedding when tied)


@dataclass
class Segment:
    """One group of rows of a packed forward (`forward_packed`): the arguments of `forward`."""

    input_ids: torch.Tensor  # [B, N] long
    positions: torch.Tensor | None  # [B, N] long; None = lengths[slot] + i
    slots: torch.Tensor | Sequence[int]  # [B]
    num_new: torch.Tensor | Sequence[int] | None = None  # [B]
    tree_mask: torch.Tensor | None = None  # [B, N, N] bool
    capture: Sequence[int] = ()
    logits: bool = True  # False: no LM head for this segment


def forward_packed(model: CausalLM, cache, segments: Sequence[Segment]) -> list[ForwardOutput]:
    """Forward several segments (distinct slots) at once: one `ForwardOutput` per segment.

    A model with `forward_segments` (NativeDecoder) packs them: its matrix products see every
    segment's tokens together and attention runs per segment, so e.g. a prompt chunk rides in a
    decode step's forward for what its extra rows cost. Any other model runs them one by one.
    Each segment's output is what `forward` gives it alone, up to the rounding of a product
    over more rows (like any batch effect).
    """
    packed = getattr(model, "forward_segments", None)
    if packed is not None and len(segments) > 1:
        return packed(cache, segments)
    return [
        model.forward(
            g.input_ids,
            g.positions,
            cache,
            g.slots,
            num_new=g.num_new,
            tree_mask=g.tree_mask,
            capture=g.capture,
            logits=g.logits,
        )
        for g in segments
    ]


def host_list(x: torch.Tensor | Sequence[int] | int | None, n: int | None = None) -> list[int] | None:
    """Scheduling metadata (slots, num_new, kept rows) as Python ints.

    Pass lists or CPU tensors: reading a CUDA tensor here would synchronise the device.
    """
    if x is None:
        return None
    if isinstance(x, int):
        return [x] * (n or 1)
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def check_capture(capture: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate capture keys: decoder layers 0..num_layers-1, or -1 for the final normed state."""
    keys = tuple(int(c) for c in capture)
    for c in keys:
        if c != FINAL_NORM and not 0 <= c < num_layers:
            raise SpecDecodeError(
                f"cannot capture hidden layer {c}: the model has decoder layers 0..{num_layers - 1} "
                f"(use -1 for the final normed state)"
            )
    return keys


def chunked_prefill(
    model: CausalLM,
    input_ids: torch.Tensor,  # [B, P] long (right-padded when ragged)
    cache,
    slots: torch.Tensor | Sequence[int],  # [B]
    num_new: torch.Tensor | Sequence[int] | None,  # [B] valid prompt tokens per row
    capture: Sequence[int],
    chunk_size: int,
) -> ForwardOutput:
    """Write and COMMIT whole prompts in chunks of `chunk_size`, from each slot's current length.

    Returns the logits of each row's last valid token, `[B, 1, V]` fp32, and the requested
    hidden states for every prompt position, `[B, P, d]` (padded positions hold garbage).
    """
    B, P = input_ids.shape
    slot_list = host_list(slots)
    counts = host_list(num_new) or [P] * B
    if any(n < 1 for n in counts) or P < 1:
        raise SpecDecodeError("prefill needs at least one prompt token per request")
    cache.check_room(slot_list, counts)
    last: list[torch.Tensor | None] = [None] * B
    parts: dict[int, list[torch.Tensor]] = {c: [] for c in capture}
    for c0 in range(0, P, chunk_size):
        c1 = min(P, c0 + chunk_size)
        valid = [max(0, min(n, c1) - c0) for n in counts]  # valid tokens of each row in this chunk
        lens = [cache.lengths[s] for s in slot_list]
        positions = torch.tensor(lens).unsqueeze(1) + torch.arange(c1 - c0)  # [B, c]
        ragged = any(v != c1 - c0 for v in valid)
        out = model.forward(
            input_ids[:, c0:c1], positions, cache, slot_list, valid if ragged else None, None, capture
        )
        for b, (n, v) in enumerate(zip(counts, valid, strict=True)):
            if v > 0 and c0 + v == n:  # this chunk holds row b's last prompt token
                last[b] = out.logits[b, v - 1]
            cache.commit(slot_list[b], v)
        for c in capture:
            parts[c].append(out.hidden[c])
    hidden = {c: torch.cat(p, 1) for c, p in parts.items()}
    return ForwardOutput(logits=torch.stack(last).unsqueeze(1), hidden=hidden)
