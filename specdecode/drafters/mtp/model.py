"""DeepSeek-style multi-token prediction (MTP) modules (DeepSeek-V3 report, sec. 2.2).

Contract:
- `MTP(cfg)`: D chained modules. Module k at position i reads the previous depth's state
  h^{k-1}_i (h^0 = the target's final normed state) and the embedding of token t_{i+k}:
      h'_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]      (2d -> d)
  then ONE transformer block (causal over the positions of its own depth, RoPE position i+k),
  giving h^k_i, which predicts t_{i+k+1} through the output head. Embedding and output head
  are the target's, shared (frozen in the frozen mode; in the native mode the MTP loss also
  trains the trunk, through h^0 and the embedding); the head is applied to the rows of a reduced draft
  vocabulary (`d2t`), gathered from the target at load time, so the checkpoint holds only the
  modules (a full-vocabulary head per draft token costs nearly a target step on small targets).
- `mtp_forward(model, embed, h0, input_ids, lengths)` -> [h^1, ..., h^D] ([B, T, d] each).
Legend: B batch, T rows, d width, D modules, Vd draft vocabulary.
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
    attend,
    rope_table,
)


@dataclass
class MTPConfig(DraftConfig):
    hidden_size: int
    num_modules: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class MTPModule(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hnorm, self.enorm = RMSNorm(d, eps=eps), RMSNorm(d, eps=eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.attn_norm, self.mlp_norm, self.out_norm = (
            RMSNorm(d, eps=eps),
            RMSNorm(d, eps=eps),
            RMSNorm(d, eps=eps),
        )
        self.attn = DraftAttention(d, d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def inp(self, h_prev: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """[B, N, d] previous-depth states and token embeddings -> [B, N, d] block input."""
        return self.proj(torch.cat([self.hnorm(h_prev), self.enorm(emb)], dim=-1))

    def qkv(self, x: torch.Tensor, cos, sin):
        return self.attn.qkv(self.attn_norm(x), cos, sin)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual attention output, then the MLP -> [B, N, d] state h^k."""
        h = x + self.attn.o_proj(attn_out)
        return h + self.mlp(self.mlp_norm(h))


class MTP(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.mods = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.num_modules))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # [Vd]
        self._head = [None]  # [Vd, d] frozen target head rows, set by attach_head (not saved)

    def attach_head(self, head_weight: torch.Tensor) -> None:
        """Gather the shared output head's draft-vocabulary rows from the target."""
        p = next(self.parameters())
        self._head[0] = head_weight[self.d2t.to(head_weight.device)].detach().to(p.device, p.dtype)

    def logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Module k's (1-based) state [.., d] -> [.., Vd] draft-vocabulary logits."""
        w = self._head[0]
        return self.mods[k - 1].out_norm(h) @ w.to(h.dtype).T


def mtp_forward(model: MTP, embed, h0: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor) -> list:
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device)
    valid = pos[None] < lengths[:, None]
    causal = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
    causal = causal | ~valid[:, :, None]  # padded queries see everything (discarded)
    h, outs = h0, []
    for k, mod in enumerate(model.mods, start=1):
        tok = F.pad(input_ids[:, k:], (0, k))  # [B, T]: token t_{i+k} at row i
        cos, sin = rope_table((pos + k)[None].expand(B, T), model.cfg.head_dim, model.cfg.rope_theta)
        x = mod.inp(h, embed(tok).to(h.dtype))
        q, kk, v = mod.qkv(x, cos, sin)
        h = mod.finish(x, attend(q, kk, v, causal))
        outs.append(h)
    return outs
