"""MTP training task, frozen-target mode, for the shared trainer.

Contract: `MTPTask(target, seqs, num_modules, draft_vocab_size)` builds `MTP` (modules sized like
one target layer; draft vocabulary = the most frequent response tokens) and a loss module that
reads the target's final normed state h^0, from which it also computes the soft labels.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.drafters.eagle.train import draft_vocabulary
from specdecode.drafters.layers import target_shape
from specdecode.drafters.mtp.drafter import MTPDrafter
from specdecode.drafters.mtp.model import MTP, MTPConfig, mtp_loss
from specdecode.models.base import FINAL_NORM


class MTPLoss(nn.Module):
    def __init__(self, net: MTP, target):
        super().__init__()
        self.net = net
        self._target = [target]

    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        target = self._target[0]
        h0 = feats[FINAL_NORM].float()  # [B, T, d]
        with torch.no_grad():
            tgt = h0 @ self.net._head[0].to(h0.device, h0.dtype).T  # [B, T, Vd]

        def embed(ids):
            return target.model.embed(ids.to(target.model.info.device)).float().to(h0.device)

        return mtp_loss(self.net, embed, h0, tgt, batch["input_ids"], batch["loss_mask"], batch["lengths"])


class MTPTask:
    method = "mtp"
    feature_layers = (FINAL_NORM,)

    def __init__(self, target, seqs, num_modules: int = 3, draft_vocab_size: int = 8192):
        info, config = target.model.info, target.config
        cfg = MTPConfig(**target_shape(info, config, draft_vocab_size), num_modules=num_modules)
        d2t, self.coverage = draft_vocabulary(
            seqs, cfg.draft_vocab_size, target.eos_token_ids, info.vocab_size
        )
        self.net = MTP(cfg)
        with torch.no_grad():
            self.net.d2t.copy_(d2t)
        self.net.to(info.device)
        self.net.attach_head(target.model.lm_head_weight().float())
        self.target = target
        self.module = MTPLoss(self.net, target)

    def arch(self) -> dict:
        return self.net.cfg.to_json()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return self.net.state_dict()

    def make_drafter(self) -> MTPDrafter:
        drafter = MTPDrafter(self.net, self.target)
        self.net.attach_head(self.target.model.lm_head_weight().float())  # keep fp32 for training
        return drafter
