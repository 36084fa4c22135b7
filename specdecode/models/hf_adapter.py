"""HFAdapter: any other transformers causal LM behind the `CausalLM` interface (batch 1).

Contract:
* One request at a time: `new_cache` accepts `num_slots == 1` only and `forward` takes B == 1.
  Architectures that need batching or speed should be native (llama, qwen2, qwen3, mistral).
* The cache (`HFCache`) wraps transformers' `DynamicCache`. Rows past the committed length are
  cropped away at the start of the next forward, so rollback is still "do not commit".
  `commit(..., kept_rows)` compacts rows in every layer, as `KVCache` does. Caches whose layers
  are not plain full-attention `DynamicLayer`s (sliding window, linear attention) are refused.
* `tree_mask` is honoured through a 4D additive attention mask for the architectures listed in
  `TREE_MODEL_TYPES` (checked against plain chains in the tests); others raise SpecDecodeError.
* `capture`: layer i < num_layers - 1 is `hidden_states[i + 1]`, -1 the final normed state;
  the raw output of the last layer is not exposed by transformers and is refused.

Legend: B batch (1), N new tokens, V head rows, d hidden size, Hk KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError
from specdecode.models.base import (
    FINAL_NORM,
    ForwardOutput,
    ModelInfo,
    check_capture,
    chunked_prefill,
    host_list,
)
from specdecode.models.kv_cache import CacheState

# Architectures whose attention takes a custom 4D mask and explicit position_ids as given.
TREE_MODEL_TYPES = ("gpt2", "opt")

TREE_UNSUPPORTED = "tree drafting needs a natively supported architecture (llama, qwen2, qwen3)"


class HFCache(CacheState):
    """One-slot cache over a transformers DynamicCache (see module docstring)."""

    def __init__(self, config, max_len: int) -> None:
        from transformers import DynamicCache  # deferred: importing transformers takes seconds
        from transformers.cache_utils import DynamicLayer

        super().__init__(1, max_len)
        try:
            self.dc = DynamicCache(config=config)
        except Exception:  # configs that the layer-type inference does not understand
            self.dc = DynamicCache()
        if any(type(layer) is not DynamicLayer for layer in self.dc.layers):
            raise SpecDecodeError(
                "this model's cache (sliding-window or recurrent layers) cannot be rolled back, so it "
                "cannot be used for speculative decoding"
            )

    def sync(self) -> None:
        """Drop rows past the committed length (the uncommitted block of the last forward)."""
        extra = self.dc.get_seq_length() - self.lengths[0]
        if extra > 0:
            self.dc.crop(-extra)

    def _compact(self, slot: int, start: int, rows: list[int]) -> None:
        idx = torch.tensor(rows) + start  # [n]
        for layer in self.dc.layers:
            for t in (layer.keys, layer.values):  # [1, Hk, T, D]
                t[:, :, start : start + len(rows)] = t.index_select(2, idx.to(t.device))


class HFAdapter:
    """A transformers `PreTrainedModel` (causal LM) as a batch-1 `CausalLM`."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        cfg = (
            model.config.get_text_config(decoder=True)
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        p = next(model.parameters())
        head = model.get_output_embeddings()
        max_pos = next(
            (
                getattr(cfg, a)
                for a in ("max_position_embeddings", "n_positions", "n_ctx")
                if getattr(cfg, a, None)
            ),
            2048,
        )
        self.config = cfg
        self.info = ModelInfo(
            arch=cfg.model_type,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            vocab_size=head.weight.shape[0] if head is not None else cfg.vocab_size,
            max_position=int(max_pos),
            dtype=p.dtype,
            device=p.device,
            num_heads=getattr(cfg, "num_attention_heads", 0) or 0,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None)
            or getattr(cfg, "num_attention_heads", 0)
            or 0,
            native=False,
            supports_tree=cfg.model_type in TREE_MODEL_TYPES,
            max_slots=1,
        )

    def new_cache(self, num_slots: int, max_len: int) -> HFCache:
        if num_slots != 1:
            raise SpecDecodeError(
                f"{self.info.arch} runs through the transformers adapter, which serves one request at a "
                "time; use max_batch=1, or a natively supported architecture (llama, qwen2, qwen3) to batch"
            )
        return HFCache(self.model.config, max_len)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def lm_head_weight(self) -> torch.Tensor:
        """[V, d] the output head."""
        return self.model.get_output_embeddings().weight

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, N] long
        positions: torch.Tensor | None,  # [1, N] long; None = lengths[0] + i
        cache: HFCache,
        slots: torch.Tensor | Sequence[int],  # [1]
        num_new: torch.Tensor | Sequence[int] | None = None,  # [1]
        tree_mask: torch.Tensor | None = None,  # [1, N, N] bool
        capture: Sequence[int] = (),
        logits: bool = True,  # accepted for interface parity; logits are always computed here
    ) -> ForwardOutput:
        B, N = input_ids.shape
        if B != 1 or host_list(slots) != [0]:
            raise SpecDecodeError(
                f"{self.info.arch} runs through the transformers adapter (batch 1, slot 0); "
                "use max_batch=1 or a natively supported architecture (llama, qwen2, qwen3)"
            )
        capture = check_capture(capture, self.info.num_layers)
        if self.info.num_layers - 1 in capture:
            raise SpecDecodeError(
                f"transformers does not expose the raw output of the last layer ({self.info.num_layers - 1}) "
                "of a non-native model; capture -1 (the final normed state) instead"
            )
        if tree_mask is not None and not self.info.supports_tree:
            raise SpecDecodeError(f"{TREE_UNSUPPORTED}; {self.info.arch} is not")
        n = N if num_new is None else host_list(num_new)[0]
        cache.check_room([0], [n])
        cache.sync()
        L, dev = cache.lengths[0], self.info.device
        if positions is None:
            positions = torch.arange(L, L + N).unsqueeze(0)
        kwargs = {"cache": cache.dc, "use_cache": True, "position_ids": positions[:, :n].to(dev)}
        if tree_mask is not None:
            allowed = torch.ones(1, 1, n, L + n, dtype=torch.bool, device=dev)  # [1, 1, n, L+n]
            allowed[..., L:] = tree_mask[:, None, :n, :n].to(dev) | torch.eye(n, dtype=torch.bool, device=dev)
            neg = torch.finfo(self.info.dtype).min
            kwargs["attention_mask"] = torch.zeros(
                allowed.shape, dtype=self.info.dtype, device=dev
            ).masked_fill(~allowed, neg)
        if capture:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=input_ids[:, :n].to(dev), **kwargs)
        logits = out.logits.float()  # [1, n, V]
        hidden = {}
        for c in capture:
            hidden[c] = out.hidden_states[-1] if c == FINAL_NORM else out.hidden_states[c + 1]  # [1, n, d]
        if n < N:  # right-pad to the requested block; padded rows hold zeros
            logits = F.pad(logits, (0, 0, 0, N - n))
            hidden = {c: F.pad(h, (0, 0, 0, N - n)) for c, h in hidden.items()}
        return ForwardOutput(logits=logits, hidden=hidden)

    __call__ = forward

    def prefill(
        self,
        input_ids: torch.Tensor,  # [1, P] long
        cache: HFCache,
        slots: torch.Tensor | Sequence[int],  # [1]
        num_new: torch.Tensor | Sequence[int] | None = None,  # [1]
        capture: Sequence[int] = (),
        chunk_size: int = 512,
    ) -> ForwardOutput:
        """Write and COMMIT the prompt in chunks (see `base.chunked_prefill`)."""
        return chunked_prefill(self, input_ids, cache, slots, num_new, capture, chunk_size)

    def parameters(self):
        return self.model.parameters()
