"""Medusa heads (Cai et al. 2024, Medusa-1: frozen target).

Contract:
- `MedusaConfig`: num_heads K, width d, draft vocabulary size; `d2t` maps draft ids to target ids.
- `Medusa(cfg)`: head k (1-based) reads the target's final normed state h_t and predicts the
  token at t + k + 1: logits_k = W (SiLU(A_k h_t) + h_t). A_k is a d x d layer per head (zero
  initialised, so every head starts as the target's own next-token head); W is ONE head over the
  reduced draft vocabulary shared by all heads and initialised from the target head's rows (K
  full-vocabulary heads would not fit the 30 MB budget of a shipped drafter on small targets).
Legend: B batch, T rows, d width, K heads, Vd draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.layers import DraftConfig, ReducedHead


@dataclass
class MedusaConfig(DraftConfig):
    hidden_size: int
    num_heads: int
    draft_vocab_size: int
    target_vocab_size: int


class Medusa(ReducedHead, nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.num_heads))
        for blk in self.blocks:
            nn.init.zeros_(blk.weight)
            nn.init.zeros_(blk.bias)
        self.head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # [Vd]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] final normed target states -> [..., K, Vd] logits of heads 1..K."""
        x = torch.stack([F.silu(blk(h)) + h for blk in self.blocks], dim=-2)  # [..., K, d]
        # one head product over the K rows: at inference the shared head's weight is read once a
        # round, not once a head (the K rows are memory-bound alike)
        return self.head(x)  # [..., K, Vd]
