"""EAGLE-3 training task for the shared trainer (specdecode.training.trainer).

Contract: `EagleTask(target, seqs, draft_vocab_size, ttt_steps)` picks the draft vocabulary (the
most frequent response tokens of the training data, EOS always included), builds an `Eagle3`
whose head starts from the target head's rows, and exposes what `train()` needs. The loss
module reads the target features (low ; mid ; high) and the target's final normed state, from
which it computes the target's logits over the draft vocabulary (the soft labels).

The loss:
- `ttt_loss(...)`: training-time test. Step 0 reads the target's features; step j > 0 reads the
  drafter's own step j-1 outputs and token x_{t+1+j}, attending causally to the step-0 keys and
  to its own chain of keys from steps 1..j (exactly what a query sees when drafting). Each step is
  a soft cross-entropy against the target's distribution over the draft vocabulary (from the
  target's final normed state; computed as KL, which has the same gradient and reads 0 for a
  perfect drafter), weighted 0.8^j and masked to response tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.drafter import Drafter
from specdecode.drafters.eagle.drafter import EagleDrafter, TreeSpec
from specdecode.drafters.eagle.model import Eagle3, EagleConfig, ttt_forward
from specdecode.drafters.layers import SoftTargets, shifted_kl
from specdecode.models.base import FINAL_NORM
from specdecode.training.vocab import pick_vocabulary


def ttt_loss(
    model: Eagle3,
    embed,  # callable: [B, T] ids -> [B, T, d]
    feats: torch.Tensor,  # [B, T, 3d]
    target_logits: torch.Tensor,  # [B, T, Vd] target logits over the draft vocab at each position
    input_ids: torch.Tensor,  # [B, T] long
    loss_mask: torch.Tensor,  # [B, T] 1 where the token at t is a response token
    lengths: torch.Tensor,  # [B]
    num_steps: int = 3,
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict]:
    """Training-time-test loss (see module docstring); returns (loss, {"acc_j": ..., "loss_j": ...})."""
    total, weight_sum, logs = 0.0, 0.0, {}
    soft = SoftTargets(target_logits)  # once for all the steps
    for j, out in enumerate(ttt_forward(model, embed, feats, input_ids, lengths, num_steps)):
        # Row t's prediction (x_{t+2+j}) is checked against the target's logits at t+1+j.
        step_loss, acc = shifted_kl(out, soft, loss_mask, lengths, shift=1 + j, head=model.logits)
        total = total + decay**j * step_loss
        weight_sum += decay**j
        logs[f"loss_{j}"], logs[f"acc_{j}"] = float(step_loss.detach()), float(acc)
    return total / weight_sum, logs


class EagleLoss(nn.Module):
    def __init__(self, net: Eagle3, target, ttt_steps: int):
        super().__init__()
        self.net = net
        self.ttt_steps = ttt_steps
        # Frozen target pieces live in a list: not parameters, not buffers (DDP leaves them alone).
        w = target.model.lm_head_weight()[net.d2t.to(target.model.info.device)]
        self._frozen = [target, w.detach().float()]

    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        target, head_w = self._frozen
        dev = batch["input_ids"].device
        layers = self.net.cfg.feature_layers
        x = torch.cat([feats[i] for i in layers], dim=-1).float()  # [B, T, 3d]
        with torch.no_grad():
            tgt = feats[FINAL_NORM].float() @ head_w.to(dev).T  # [B, T, Vd]

        def embed(ids):
            return target.model.embed(ids.to(target.model.info.device)).float().to(dev)

        return ttt_loss(
            self.net,
            embed,
            x,
            tgt,
            batch["input_ids"],
            batch["loss_mask"],
            batch["lengths"],
            num_steps=self.ttt_steps,
        )


class EagleTask:
    method = "eagle"

    def __init__(self, target, seqs, draft_vocab_size: int = 8192, ttt_steps: int = 3, d2t=None):
        info = target.model.info
        cfg = EagleConfig.for_target(info, target.config, draft_vocab_size)
        d2t, self.coverage = pick_vocabulary(
            seqs, cfg.draft_vocab_size, target.eos_token_ids, info.vocab_size, d2t
        )
        self.net = Eagle3(cfg)
        self.net.init_from_target(target.model.lm_head_weight().detach().cpu(), d2t)
        self.net.to(info.device)
        self.target = target
        self.module = EagleLoss(self.net, target, ttt_steps)
        self.feature_layers = (*cfg.feature_layers, FINAL_NORM)

    def arch(self) -> dict:
        return self.net.cfg.to_json()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return self.net.state_dict()

    def make_drafter(self, tree: TreeSpec | None = None) -> Drafter:
        return EagleDrafter(self.net, self.target, tree=tree)
