"""Target runtime: the `CausalLM` interface, its KV cache, the native decoder and the loader.

Contract: see `base.py` (interface and layer-index convention) and docs/ARCHITECTURE.md.
`load_model(spec)` is the entry point; it returns a `LoadedModel` whose `.model` is a
`NativeDecoder` (llama / qwen2 / qwen3 / mistral) or an `HFAdapter` (anything else, batch 1).
"""

from specdecode.models.base import FINAL_NORM, CausalLM, ForwardOutput, ModelInfo
from specdecode.models.hf_adapter import HFAdapter, HFCache
from specdecode.models.kv_cache import CacheState, KVCache
from specdecode.models.loader import (
    LoadedModel,
    load_model,
    model_fingerprint,
    same_tokenizer,
    tokenizer_fingerprint,
)
from specdecode.models.native import NativeDecoder

__all__ = [
    "FINAL_NORM",
    "CacheState",
    "CausalLM",
    "ForwardOutput",
    "HFAdapter",
    "HFCache",
    "KVCache",
    "LoadedModel",
    "ModelInfo",
    "NativeDecoder",
    "load_model",
    "model_fingerprint",
    "same_tokenizer",
    "tokenizer_fingerprint",
]
