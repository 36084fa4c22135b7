"""DSpark training task: the DFlash task with the anchor-slot layout, the Markov and confidence
heads, and the distribution-matching loss (needs the target's final normed state for p_t).

Contract: `DSparkTask(target, seqs, num_layers, block_size, draft_vocab_size, num_anchors,
markov_rank)`; `make_drafter()` returns a `DSparkDrafter` over the current weights.
"""

from __future__ import annotations

import torch

from specdecode.drafters.dflash.train import DFlashLoss, DFlashTask
from specdecode.drafters.dspark.drafter import DSparkDrafter
from specdecode.drafters.dspark.model import DSpark, dspark_loss
from specdecode.models.base import FINAL_NORM


class DSparkLoss(DFlashLoss):
    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        _, head_w, t2d = self._frozen
        dev = batch["input_ids"].device
        head_w = head_w.to(dev)
        packed = self.pack(batch, feats)
        S, A, K = packed["label_pos"].shape
        with torch.no_grad():  # the target's distribution for each label, from the row before it
            rows = (packed["label_pos"] - 1).clamp(max=feats[FINAL_NORM].shape[1] - 1).view(S, -1)
            h = torch.gather(
                feats[FINAL_NORM].to(dev).float(), 1, rows[..., None].expand(-1, -1, head_w.shape[1])
            )
            tgt = (h @ head_w.T).view(S, A, K, -1)  # [S, A, K, Vd]
        return dspark_loss(self.net, head_w, t2d, packed, tgt)


class DSparkTask(DFlashTask):
    method = "dspark"
    layout = "dspark"
    loss_cls = DSparkLoss

    def __init__(self, target, seqs, block_size: int = 7, markov_rank: int = 256, **kw):
        super().__init__(target, seqs, block_size=block_size, markov_rank=markov_rank, **kw)
        self.feature_layers = (*self.feature_layers, FINAL_NORM)

    def make_net(self, cfg) -> DSpark:
        return DSpark(cfg)

    def make_drafter(self) -> DSparkDrafter:
        return DSparkDrafter(self.net, self.target)
