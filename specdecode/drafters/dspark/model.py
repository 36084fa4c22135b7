"""DSpark network (docs/methods.md, "DSpark"): the DFlash backbone with the anchor-slot
layout, a low-rank Markov head and a confidence head.

Contract:
- `DSpark(cfg)` extends `DFlash` (cfg.layout == "dspark": slot k predicts anchor + k + 1, so all
  `block_size` slots are drafts). Markov head: `W1` an embedding (Vd + 1) x r over draft ids
  (row Vd stands for every token outside the draft vocabulary), `W2` Linear(r -> Vd), zero
  initialised so training starts from the backbone's own logits.
- `markov_logits(U [.., Vd], prev_draft_ids [..])` = U + W2(W1[prev]): the corrected logits of a
  slot given the token before it (x_0 = the anchor). `confidence_logit(h [.., d], prev)` =
  Linear(d + r -> 1)([h ; W1[prev]]); c = sigmoid(logit / sts_temperature[k]), the probability
  that draft k is accepted given every earlier draft was; known before x_k is sampled.
  `sts_temperature` [block_size] is a buffer (ones until `specdecode calibrate` fits it); with
  `calibrate --bias` a per-position `sts_bias` is added to the scaled logit (zeros otherwise).
- `confidence_tables()` -> (w [d], row [Vd + 1]) fp32 with confidence_logit(h, prev) =
  h @ w + row[prev]: the head split into its state part (one product for every slot of a block)
  and a table over the previous token (inference reads one entry per slot).
- `markov_table()` -> [Vd + 1, Vd] fp32 with markov_logits(U, prev) = U + table[prev]: the
  Markov correction of every previous token, so a drafting slot gathers one row (Vd values)
  instead of multiplying by W2 (r x Vd: 8 MB in fp32 for Vd 8192, read once per slot).
Legend: as in dflash/model.py; r Markov rank.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.drafters.dflash.model import DFlash, DFlashConfig


class DSpark(DFlash):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__(cfg)
        r, Vd = cfg.markov_rank, cfg.draft_vocab_size
        self.W1 = nn.Embedding(Vd + 1, r)
        self.W2 = nn.Linear(r, Vd, bias=False)
        nn.init.normal_(self.W1.weight, std=0.02)
        nn.init.zeros_(self.W2.weight)
        self.conf = nn.Linear(cfg.hidden_size + r, 1)
        self.register_buffer("sts_temperature", torch.ones(cfg.block_size))  # [block_size]
        self.register_buffer("sts_bias", torch.zeros(cfg.block_size))  # [block_size] (opt-in, 0)

    def markov_logits(self, U: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return U + self.W2(self.W1(prev)).to(U.dtype)

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.conf(torch.cat([h, self.W1(prev).to(h.dtype)], dim=-1))[..., 0]

    @torch.no_grad()
    def confidence_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.hidden_size
        w = self.conf.weight.float()[0]  # [d + r]
        row = self.W1.weight.float() @ w[d:] + self.conf.bias.float()  # [Vd + 1]
        return w[:d], row

    @torch.no_grad()
    def markov_table(self) -> torch.Tensor:
        return self.W1.weight.float() @ self.W2.weight.float().T  # [Vd + 1, Vd]
