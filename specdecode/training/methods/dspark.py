"""DSpark training task: the DFlash task with the anchor-slot layout, the Markov and confidence
heads, and the distribution-matching loss (needs the target's final normed state for p_t).

Contract: `DSparkTask(target, seqs, num_layers, block_size, draft_vocab_size, num_anchors,
markov_rank)`; `make_drafter()` returns a `DSparkDrafter` over the current weights. The loss gets
p_t over the full vocabulary: the draft-vocabulary logits plus the log-sum-exp of all the
target's logits (computed in row chunks with the full head).
"""

from __future__ import annotations

import torch

from specdecode.drafters.dspark.drafter import DSparkDrafter
from specdecode.drafters.dspark.model import DSpark, dspark_loss
from specdecode.models.base import FINAL_NORM
from specdecode.training.methods.dflash import DFlashLoss, DFlashTask


class DSparkLoss(DFlashLoss):
    def __init__(self, net, target, num_anchors: int):
        super().__init__(net, target, num_anchors)
        # The frozen full head in fp32, for the target's log-sum-exp (kept out of the state dict).
        self._full_head = [target.model.lm_head_weight().float()]  # [V, d]

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
            lse = full_logsumexp(h.view(-1, h.shape[-1]), self._full_head[0]).view(S, A, K)
        return dspark_loss(self.net, head_w, t2d, packed, tgt, lse)


def full_logsumexp(h: torch.Tensor, head: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[N, d] states, [V, d] head -> [N] log-sum-exp of the full-vocabulary logits (fp32)."""
    w = head.to(h.device, torch.float32)
    parts = [torch.logsumexp(h[i : i + chunk].float() @ w.T, dim=-1) for i in range(0, len(h), chunk)]
    return torch.cat(parts)


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
