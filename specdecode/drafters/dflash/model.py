"""DFlash block-diffusion drafter network (docs/methods.md, "DFlash").
DSpark (drafters/dspark/) reuses this backbone with the anchor-slot layout.

Contract:
- `DFlashConfig`: architecture fields (config.json). `feature_layers` are 5 target decoder layers
  spread uniformly from the 2nd to the 3rd-to-last (`dflash_layers(L)`; never the final normed
  state). `block_size` slots per block. `layout` "dflash": slot 0 is the anchor and slot k >= 1
  predicts the token at anchor + k (block_size - 1 drafts); "dspark": slot k (0-based) predicts
  anchor + k + 1 (block_size drafts). `draft_vocab_size` < target vocab restricts the frozen
  head to the most frequent response tokens (`d2t[i]` = target id of draft id i); the paper
  uses the full vocabulary.
- `DFlash(cfg)`: `fuse` = Linear(5d -> d, no bias) + RMSNorm turns target features into context
  features; `num_layers` decoder layers at the target's width; in every layer the keys/values
  are [proj(context) ; proj(block)] with the layer's own projections (KV injection; RoPE at
  absolute positions on both), queries come from the block only, attention is non-causal inside
  the block. Final norm, then the target's frozen LM head rows of the draft vocabulary (passed in
  as `head_w`, never stored). Slot 0 reads the target's frozen embedding of the anchor; mask slots
  read a learned mask vector `mask_emb`, which no token id produces.
- Two optional architecture fields, off by default (every checkpoint without them loads and
  computes as before), make the layer the published one (z-lab / speculators / vLLM DFlash, a
  Qwen3 layer): `qk_norm` adds per-head RMSNorms `attn.q_norm` / `attn.k_norm` [D] on queries and
  keys before RoPE (context and block rows alike); `mask_token_id` makes the mask slots read the
  target's embedding of that token (the network then has no `mask_emb`). `mask_vector(embed)`
  gives what the mask slots read; `block_input(anchor_emb, mask)` builds the block from it.
- `context_kv(ctx [S, T, d], positions [S, T])` -> per layer (k, v) `[S, T, Hk, D]`: exactly what
  the inference cache stores for committed context rows.
- `block_states(emb [S, A, B, d], positions [S, A, B], ctx_kv, ctx_visible [S, A, T])` -> final
  states `[S, A, B, d]` of A blocks per sequence; `ctx_visible` marks the context rows a block may
  read (strictly before its anchor, at training and at inference).
- `draft_states(block [S, B, d], positions [S, B], ctx_kv, ctx_visible [S, T] | None)`: the same
  computation for one block per request at inference, reading the keys/values in the cache's own
  layout (`[S, Hk, T, D]` per layer, views, no copies) through one fused attention call per layer.
Legend: S sequences (or requests), T context rows, A blocks per sequence, B slots per block,
d width, H/Hk heads, D head dim, Vd draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.layers import (
    DraftAttention,
    DraftConfig,
    RMSNorm,
    SwiGLU,
    rope_table,
    target_shape,
)
from specdecode.errors import SpecDecodeError


def dflash_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """Target layers (0-based) uniform from the 2nd to the 3rd-to-last: round(1 + i (L-4)/(count-1))."""
    if num_layers < 4:  # tiny test targets: spread over what exists
        return tuple(min(i, num_layers - 1) for i in range(count))
    return tuple(round(1 + i * (num_layers - 4) / (count - 1)) for i in range(count))


@dataclass
class DFlashConfig(DraftConfig):
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    target_vocab_size: int
    num_layers: int = 2
    block_size: int = 8
    layout: str = "dflash"
    loss_decay: float = 4.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    markov_rank: int = 0  # DSpark only
    qk_norm: bool = False  # per-head q/k RMSNorm before RoPE (Qwen3, the published DFlash layer)
    mask_token_id: int | None = None  # mask slots read the target's embedding of this id, not mask_emb

    def __post_init__(self) -> None:
        if self.layout not in ("dflash", "dspark"):
            raise SpecDecodeError(f"DFlash layout must be 'dflash' or 'dspark', got {self.layout!r}")
        m = self.mask_token_id
        if m is not None and not (isinstance(m, int) and 0 <= m < self.target_vocab_size):
            raise SpecDecodeError(
                f"mask_token_id {m!r} is not a row of the target's embedding "
                f"(0..{self.target_vocab_size - 1}); pick a token id the target has (an unused special token)"
            )

    @property
    def first_draft_slot(self) -> int:
        return 1 if self.layout == "dflash" else 0

    @property
    def num_drafts(self) -> int:
        return self.block_size - self.first_draft_slot

    @classmethod
    def for_target(cls, info, config, draft_vocab_size: int, **kw) -> DFlashConfig:
        return cls(
            **target_shape(info, config, draft_vocab_size),
            feature_layers=dflash_layers(info.num_layers),
            **kw,
        )


def block_attend(q, ctx_k, ctx_v, blk_k, blk_v, ctx_visible) -> torch.Tensor:
    """Block queries over [context ; own block]. q [S, A, B, H, D]; ctx_k/v [S, T, Hk, D];
    blk_k/v [S, A, B, Hk, D]; ctx_visible [S, A, T] bool -> [S, A, B, H*D]. The whole block is
    visible to each of its slots (non-causal); no block sees another block."""
    S, A, B, H, D = q.shape
    T = ctx_k.shape[1]
    g = H // blk_k.shape[3]
    ck, cv = ctx_k.repeat_interleave(g, dim=2), ctx_v.repeat_interleave(g, dim=2)  # [S, T, H, D]
    bk, bv = blk_k.repeat_interleave(g, dim=3), blk_v.repeat_interleave(g, dim=3)  # [S, A, B, H, D]
    scale = D**-0.5
    sc = torch.einsum("sabhd,sthd->sahbt", q, ck) * scale  # [S, A, H, B, T]
    sc = sc.masked_fill(~ctx_visible[:, :, None, None, :], float("-inf"))
    sb = torch.einsum("sabhd,sachd->sahbc", q, bk) * scale  # [S, A, H, B, B]
    p = torch.softmax(torch.cat([sc, sb], dim=-1).float(), dim=-1).to(q.dtype)
    o = torch.einsum("sahbt,sthd->sabhd", p[..., :T], cv) + torch.einsum("sahbc,sachd->sabhd", p[..., T:], bv)
    return o.reshape(S, A, B, H * D)


class InjectLayer(nn.Module):
    """One decoder layer whose attention also reads the injected context keys/values."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.input_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.attn = DraftAttention(
            d, d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps
        )
        self.post_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def context_kv(self, ctx: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [S, T, d] -> k, v [S, T, Hk, D] (k normed when qk_norm, RoPE on k)."""
        return self.attn.kv(ctx, cos, sin)

    def forward(self, h, cos, sin, ctx_k, ctx_v, ctx_visible) -> torch.Tensor:
        """h [S, A, B, d]; cos/sin [S, A*B, D] -> [S, A, B, d]."""
        S, A, B, d = h.shape
        q, k, v = self.attn.qkv(self.input_norm(h).reshape(S, A * B, d), cos, sin)
        split = lambda t: t.view(S, A, B, *t.shape[2:])  # noqa: E731
        o = block_attend(split(q), ctx_k, ctx_v, split(k), split(v), ctx_visible)
        h = h + self.attn.o_proj(o)
        return h + self.mlp(self.post_norm(h))

    def forward_cached(self, h, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """One block per request (inference): h [S, B, d]; cos/sin [S, B, D]; ctx_k/v
        [S, Hk, T, D] (the cache layout); mask [S, 1, 1, T + B] bool or None (all visible)."""
        S, B, _ = h.shape
        q, k, v = self.attn.qkv(self.input_norm(h), cos, sin)  # [S, B, H|Hk, D]
        keys = torch.cat([ctx_k, k.transpose(1, 2)], dim=2)  # [S, Hk, T + B, D]
        values = torch.cat([ctx_v, v.transpose(1, 2)], dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        h = h + self.attn.o_proj(o.transpose(1, 2).reshape(S, B, -1))  # o [S, H, B, D]
        return h + self.mlp(self.post_norm(h))


class DFlash(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.feature_layers) * d, d, bias=False)
        self.ctx_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(InjectLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        if cfg.mask_token_id is None:  # with a mask token the slots read the target's embedding
            self.mask_emb = nn.Parameter(torch.zeros(d))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # [Vd]

    def init_from_target(self, embed_weight: torch.Tensor, d2t: torch.Tensor) -> None:
        """The mask vector starts as the mean token embedding; `d2t` = the draft vocabulary."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            if self.cfg.mask_token_id is None:
                self.mask_emb.copy_(embed_weight.float().mean(0))

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[.., 5d] target features (layer order of cfg.feature_layers) -> [.., d] context."""
        return self.ctx_norm(self.fc(feats))

    def _rope(self, positions: torch.Tensor):
        return rope_table(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self._rope(positions)
        return [layer.context_kv(ctx, cos, sin) for layer in self.layers]

    def block_states(self, emb, positions, ctx_kv, ctx_visible) -> torch.Tensor:
        S, A, B, d = emb.shape
        cos, sin = self._rope(positions.reshape(S, A * B))
        h = emb
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            h = layer(h, cos, sin, k, v, ctx_visible)
        return self.norm(h)

    def draft_states(self, block, positions, ctx_kv, ctx_visible) -> torch.Tensor:
        """block [S, B, d], positions [S, B], ctx_kv per layer (k, v) [S, Hk, T, D], ctx_visible
        [S, T] bool or None (every row visible) -> final states [S, B, d]; equals `block_states`
        with A = 1 (the block sees every visible context row and its whole self)."""
        S, B, _ = block.shape
        cos, sin = self._rope(positions)
        mask = None
        if ctx_visible is not None:  # [S, 1, 1, T + B]: context rows per request, then the block
            mask = torch.cat([ctx_visible, ctx_visible.new_ones(S, B)], dim=1)[:, None, None]
        h = block
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            h = layer.forward_cached(h, cos, sin, k, v, mask)
        return self.norm(h)

    def mask_vector(self, embed) -> torch.Tensor:
        """[d] what every mask slot reads: `mask_emb`, or with `mask_token_id` the target's
        embedding of that token (`embed`: [..] ids -> [.., d], the frozen target embedding)."""
        if self.cfg.mask_token_id is None:
            return self.mask_emb
        ids = torch.tensor([self.cfg.mask_token_id], device=self.d2t.device)
        return embed(ids)[0]

    def block_input(self, anchor_emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[S, A, d] anchor embeddings, [d] mask vector -> [S, A, B, d] block input (anchor, then
        mask vectors)."""
        S, A, d = anchor_emb.shape
        mask = mask.to(anchor_emb.device, anchor_emb.dtype).expand(S, A, self.cfg.block_size - 1, d)
        return torch.cat([anchor_emb[:, :, None], mask], dim=2)

    def logits(self, states: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
        """[.., d] final states -> [.., Vd] logits with the frozen target head rows [Vd, d]."""
        # One [N, d] x [d, Vd] product: a strided N-D `states` (the DFlash slice past the anchor)
        # would make matmul broadcast the head to every batch row instead (a [N, d, Vd] copy).
        flat = states.reshape(-1, states.shape[-1])  # [N, d]
        return (flat @ head_w.T.to(states.dtype)).view(*states.shape[:-1], -1)


def to_draft_ids(ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (Vd for tokens outside the draft vocabulary)."""
    return t2d.to(ids.device)[ids]


def slot_accuracy(logits, y, w, slots=(0, 1, 3)) -> dict:
    """Argmax agreement with the label at a few draft positions (for the training log)."""
    logs = {}
    with torch.no_grad():
        hit = (logits.argmax(-1) == y).float()
        m = (w > 0).float()
        for j in slots:
            if j < hit.shape[-1]:
                logs[f"acc_{j}"] = float((hit[..., j] * m[..., j]).sum() / m[..., j].sum().clamp(min=1))
    return logs


def t2d_table(d2t: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """[V] target id -> draft id, Vd where the token has no draft id."""
    t2d = torch.full((vocab_rows,), len(d2t), dtype=torch.long)
    t2d[d2t.cpu()] = torch.arange(len(d2t))
    return t2d


def default_decay(block_size: int) -> float:
    """DFlash's gamma_d: 7 at B = 16, 5 at B = 10, 4 at B = 8 (B / 2 elsewhere, at least 2)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(2.0, block_size / 2))
