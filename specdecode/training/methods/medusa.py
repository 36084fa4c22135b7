"""Medusa-1 training task (frozen target) for the shared trainer.

Contract: `MedusaTask(target, seqs, num_heads, draft_vocab_size)` builds `Medusa` with the most
frequent response tokens as draft vocabulary (shared with EAGLE's choice) and a loss module that
reads the target's final normed state (`-1`) and computes the soft labels from it.

The loss:
- `medusa_loss(...)`: head k is trained against the target's own distribution at position
  t + k (self-distillation, soft labels over the draft vocabulary, computed as KL), weighted
  0.8^k, masked to response tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.drafters.layers import SoftTargets, shifted_kl
from specdecode.drafters.medusa.drafter import MedusaDrafter
from specdecode.drafters.medusa.model import Medusa, MedusaConfig
from specdecode.models.base import FINAL_NORM
from specdecode.training.vocab import pick_vocabulary


def medusa_loss(
    model: Medusa,
    h: torch.Tensor,  # [B, T, d] final normed target states
    target_logits: torch.Tensor,  # [B, T, Vd] target logits over the draft vocab
    loss_mask: torch.Tensor,  # [B, T] 1 where the token at t is a response token
    lengths: torch.Tensor,  # [B]
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict]:
    logits = model(h)  # [B, T, K, Vd]
    total, wsum, logs = 0.0, 0.0, {}
    soft = SoftTargets(target_logits)  # once for all the heads
    for k in range(1, model.cfg.num_heads + 1):
        # Head k at row t predicts x_{t+k+1}; the target's distribution for it sits at row t+k.
        step, acc = shifted_kl(logits[:, :, k - 1], soft, loss_mask, lengths, shift=k)
        total = total + decay**k * step
        wsum += decay**k
        logs[f"loss_{k}"], logs[f"acc_{k}"] = float(step.detach()), float(acc)
    return total / wsum, logs


class MedusaLoss(nn.Module):
    def __init__(self, net: Medusa, target):
        super().__init__()
        self.net = net
        w = target.model.lm_head_weight()[net.d2t.to(target.model.info.device)]
        self._frozen = [w.detach().float()]

    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        h = feats[FINAL_NORM].float()  # [B, T, d]
        with torch.no_grad():
            tgt = h @ self._frozen[0].to(h.device).T  # [B, T, Vd]
        return medusa_loss(self.net, h, tgt, batch["loss_mask"], batch["lengths"])


class MedusaTask:
    method = "medusa"
    feature_layers = (FINAL_NORM,)

    def __init__(self, target, seqs, num_heads: int = 4, draft_vocab_size: int = 8192, d2t=None):
        info = target.model.info
        cfg = MedusaConfig(
            info.hidden_size, num_heads, min(draft_vocab_size, info.vocab_size), info.vocab_size
        )
        d2t, self.coverage = pick_vocabulary(
            seqs, cfg.draft_vocab_size, target.eos_token_ids, info.vocab_size, d2t
        )
        self.net = Medusa(cfg)
        self.net.init_from_target(target.model.lm_head_weight().detach().cpu(), d2t)
        self.net.to(info.device)
        self.target = target
        self.module = MedusaLoss(self.net, target)

    def arch(self) -> dict:
        return self.net.cfg.to_json()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return self.net.state_dict()

    def make_drafter(self, tree=None) -> MedusaDrafter:
        return MedusaDrafter(self.net, self.target, tree=tree)
