"""What the native decoder reads from a transformers config: `NativeSpec` and the RoPE table.

Contract: `NativeSpec.from_config(config)` takes the shape fields of a llama / qwen2 / qwen3 /
mistral config (`NATIVE_MODEL_TYPES`) and refuses, with a `SpecDecodeError` naming the field,
what the native decoder does not implement (other model types, sliding windows, other RoPE
types). `rope_inv_freq(config, head_dim)` gives the inverse frequencies of the `default`,
`linear` and `llama3` RoPE types exactly as transformers computes them (fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdecode.errors import SpecDecodeError

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class NativeSpec:
    """The architecture facts NativeDecoder needs, read once from a transformers config."""

    model_type: str
    num_layers: int
    hidden_size: int  # d
    intermediate_size: int  # I
    num_heads: int  # H
    num_kv_heads: int  # Hk
    head_dim: int  # D
    vocab_size: int  # V
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qk_norm: bool  # qwen3
    inv_freq: tuple[float, ...]  # [D/2] RoPE inverse frequencies (after scaling)
    sliding_window: int | None  # when set, caches longer than this are refused

    @classmethod
    def from_config(cls, config) -> NativeSpec:
        mt = getattr(config, "model_type", None)
        if mt not in NATIVE_MODEL_TYPES:
            raise SpecDecodeError(f"NativeDecoder supports {NATIVE_MODEL_TYPES}, not model_type {mt!r}")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise SpecDecodeError(
                f"NativeDecoder supports the SiLU MLP only, this config has hidden_act={act!r}"
            )
        d, h = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or d // h
        window = None
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
            mt == "mistral" and getattr(config, "sliding_window", None)
        ):
            window = getattr(config, "sliding_window", None)
        return cls(
            model_type=mt,
            num_layers=config.num_hidden_layers,
            hidden_size=d,
            intermediate_size=config.intermediate_size,
            num_heads=h,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or h,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position=int(getattr(config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=mt == "qwen3",
            inv_freq=tuple(rope_inv_freq(config, head_dim).tolist()),
            sliding_window=window,
        )


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies for the config's rope type (default, linear, llama3)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)  # transformers 4.x configs
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise SpecDecodeError("partial rotary embeddings are not supported by NativeDecoder")
    # Same expression as transformers, so fp32 results agree bit for bit.
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / params["factor"]
    if rope_type == "llama3":
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled)
    raise SpecDecodeError(
        f"rope type {rope_type!r} is not supported natively (default, linear, llama3 are); "
        "this model cannot be used as a native target"
    )
