"""EAGLE-3 drafter network (docs/methods.md, "EAGLE-3").

Contract:
- `EagleConfig`: architecture fields stored in the checkpoint's config.json. `feature_layers`
  are the target decoder layers (0-based) fused as low / middle / high features.
- `Eagle3(cfg)`: fc (3d -> d) fuses the target features; ONE decoder layer whose attention reads
  [RMSNorm(Emb(token)) ; RMSNorm(feature)] (2d) and whose residual stream is the feature; a final
  norm and a head over the reduced draft vocabulary (`d2t[i]` = target id of draft id i).
  The target's embedding is frozen and shared (passed in, never stored).
- Row alignment: row t holds (feature of position t, token x_{t+1}) at RoPE position t + 1 and
  predicts x_{t+2}. Its output state is the "feature" the next draft step reads.
Legend: B batch, T sequence rows, d width, Vd draft vocabulary, H/Hk heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.layers import (
    DraftAttention,
    DraftConfig,
    ReducedHead,
    RMSNorm,
    SwiGLU,
    rope_table,
    target_shape,
)


@dataclass
class EagleConfig(DraftConfig):
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, int, int]
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def for_target(cls, info, config, draft_vocab_size: int) -> EagleConfig:
        """EAGLE-3's layer choice: low = layer 1, middle = L/2 - 1, high = L - 4 (0-based)."""
        n = info.num_layers
        return cls(
            **target_shape(info, config, draft_vocab_size),
            feature_layers=(min(1, n - 1), max(0, n // 2 - 1), max(0, n - 4)),
        )


class Eagle3(ReducedHead, nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.input_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.attn = DraftAttention(2 * d, d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.post_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # [Vd]

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, T, 3d] target features (low ; mid ; high) -> [B, T, d]."""
        return self.fc(feats)

    def layer_in(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, d] token embeddings and features -> [B, T, 2d] attention input."""
        return torch.cat([self.input_norm(emb), self.hidden_norm(hidden)], dim=-1)

    def layer_out(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual on the feature stream, then the MLP: -> [B, T, d] output state."""
        h = hidden + self.attn.o_proj(attn_out)
        return h + self.mlp(self.post_norm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[.., d] output states -> [.., Vd] draft-vocabulary logits."""
        return self.head(self.norm(out))


def _ttt_attend(q, keys, values, causal):
    """q [B, T, H, D]; keys/values: list of [B, T, Hk, D] (step 0 first); causal [B, T, T] bool.

    Row t sees step-0 rows <= t (by `causal`) and, of every later step, its own row only.
    """
    B, T, H, D = q.shape
    g = H // keys[0].shape[2]
    ks = [k.repeat_interleave(g, dim=2) for k in keys]
    vs = [v.repeat_interleave(g, dim=2) for v in values]
    scale = D**-0.5
    s0 = torch.einsum("bthd,bshd->bhts", q, ks[0]) * scale  # [B, H, T, T]
    s0 = s0.masked_fill(~causal.unsqueeze(1), float("-inf"))
    diag = [(q * k).sum(-1).transpose(1, 2).unsqueeze(-1) * scale for k in ks[1:]]  # [B, H, T, 1] each
    p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)  # [B, H, T, T + j]
    o = torch.einsum("bhts,bshd->bthd", p[..., :T], vs[0])  # [B, T, H, D]
    for i, v in enumerate(vs[1:]):
        o = o + p[..., T + i].transpose(1, 2).unsqueeze(-1) * v
    return o.reshape(B, T, H * D)


def ttt_forward(
    model: Eagle3,
    embed,  # callable: [B, T] ids -> [B, T, d] (the target's frozen embedding)
    feats: torch.Tensor,  # [B, T, 3d] target features (low ; mid ; high) at each position
    input_ids: torch.Tensor,  # [B, T] long
    lengths: torch.Tensor,  # [B] valid rows per sequence
    num_steps: int,
) -> list[torch.Tensor]:
    """Output states [B, T, d] of each unrolled step (see module docstring)."""
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device)
    valid = pos[None] < lengths[:, None]  # [B, T]
    causal = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
    hidden = model.fuse(feats)  # [B, T, d]
    keys, values, outs = [], [], []
    for j in range(num_steps):
        # Row t reads token x_{t+1+j} (padding past the end) at position t+1+j; predicts x_{t+2+j}.
        shift = 1 + j
        tok = F.pad(input_ids[:, shift:], (0, shift))  # [B, T]
        cos, sin = rope_table((pos + shift)[None].expand(B, T), model.cfg.head_dim, model.cfg.rope_theta)
        q, k, v = model.attn.qkv(model.layer_in(embed(tok).to(hidden.dtype), hidden), cos, sin)
        keys.append(k)
        values.append(v)
        hidden = model.layer_out(hidden, _ttt_attend(q, keys, values, causal))  # [B, T, d]
        outs.append(hidden)
    return outs
