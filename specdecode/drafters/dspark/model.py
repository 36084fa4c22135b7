"""DSpark network and loss (docs/methods.md, "DSpark"): the DFlash backbone with the anchor-slot
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
- `dspark_loss(net, head_w, t2d, packed, target_logits, target_lse)`: with p_d = softmax of the
  teacher-forced Markov logits and p_t = the target's next-token distribution at the aligned
  position (T = 1), every term weighted exp(-(k-1)/4) and normalised by the weight sum:
  0.1 CE(p_d, x*) + 0.9 sum|p_d - p_t| + 1.0 BCE(c_k, 1 - sum|p_d - p_t| / 2), target detached.
  The sums run over the full vocabulary: p_d is zero outside the draft vocabulary, so the
  target's mass there (from `target_lse`, the log-sum-exp of its full-vocabulary logits) adds
  to the L1 and lowers the acceptance label, which is then exactly the acceptance probability
  1 - TV(p_d, p_t) of rejection sampling. Without `target_lse`, p_t is renormalised on the draft
  vocabulary (an approximation that over-states acceptance by the off-vocabulary mass).
Legend: as in dflash/model.py; r Markov rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.dflash.model import DFlash, DFlashConfig, slot_accuracy, to_draft_ids


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


def dspark_loss(
    net: DSpark,
    head_w,
    t2d,
    packed: dict,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """packed: from `block_batch`; target_logits [S, A, K, Vd]: the target at label_pos - 1 on the
    draft vocabulary; target_lse [S, A, K]: log-sum-exp of its full-vocabulary logits there."""
    h = packed["states"]  # [S, A, K, d]
    prev = to_draft_ids(packed["prev"], t2d)  # teacher forcing: the real token before each label
    logits = net.markov_logits(net.logits(h, head_w).float(), prev)  # [S, A, K, Vd]
    y = to_draft_ids(packed["labels"], t2d)
    Vd = logits.shape[-1]
    w = packed["weight"]
    logp_d = torch.log_softmax(logits, dim=-1)
    p_d = logp_d.exp()
    if target_lse is None:
        p_t = torch.softmax(target_logits.float(), dim=-1)
        off = torch.zeros_like(p_d[..., 0])
    else:
        p_t = torch.exp(target_logits.float() - target_lse.float()[..., None])  # [S, A, K, Vd]
        off = (1.0 - p_t.sum(-1)).clamp(min=0.0)  # [S, A, K] target mass outside the draft vocabulary
    ce = -torch.gather(logp_d, -1, y.clamp(max=Vd - 1)[..., None])[..., 0] * (y < Vd).float()
    l1 = (p_d - p_t).abs().sum(-1) + off  # [S, A, K] = 2 TV over the full vocabulary
    c_logit = net.confidence_logit(h.float(), prev)
    acc_target = (1 - 0.5 * l1).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(c_logit, acc_target, reduction="none")
    norm = w.sum().clamp(min=1e-6)
    parts = {k: (v * w).sum() / norm for k, v in (("ce", ce), ("l1", l1), ("bce", bce))}
    loss = 0.1 * parts["ce"] + 0.9 * parts["l1"] + 1.0 * parts["bce"]
    logs = {f"loss_{k}": float(v.detach()) for k, v in parts.items()} | slot_accuracy(logits, y, w)
    with torch.no_grad():
        m = (w > 0).float()
        exp_acc = (acc_target * m).sum((0, 1)) / m.sum((0, 1)).clamp(min=1)
        for j in (0, 1, 3):
            if j < exp_acc.shape[0]:
                logs[f"accept_{j}"] = float(exp_acc[j])  # E[min(p_d, p_t)] per draft position
    return loss, logs
