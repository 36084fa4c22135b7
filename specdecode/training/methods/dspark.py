"""DSpark training task: the DFlash task with the anchor-slot layout, the Markov and confidence
heads, and the distribution-matching loss (needs the target's final normed state for p_t).

Contract: `DSparkTask(target, seqs, num_layers, block_size, draft_vocab_size, num_anchors,
markov_rank, train_only=None)`; `make_drafter()` returns a `DSparkDrafter` over the current weights.
`train_only="confidence"` (`train dspark --train-only confidence`, with `--init-from` a trained
drafter) leaves every weight but the confidence head's without gradient: the head alone learns,
e.g. on answers regenerated at the temperature it will serve at (its acceptance labels depend on
the contexts it sees); the checkpoint's training record says so (`train_only`). A warm start
(`after_warm_start`) resets the STS temperatures and bias: they belonged to the old head.
The loss gets p_t over the full vocabulary: the draft-vocabulary logits plus the log-sum-exp of
all the target's logits, both from one product of the target's own head (its measured formats)
per row chunk, once per distinct row (the blocks of nearby anchors overlap).
`DSparkLoss.terms(batch, feats)` gives the loss's per-label quantities (`dspark_terms`) instead
of the loss: the confidence logits beside their labels, for an offline calibration check
(training/calibrate.py, `offline_calibration`).

The loss:
- `dspark_terms(net, head_w, t2d, packed, target_logits, target_lse)` -> the per-label
  quantities below (logits, labels, CE, L1, the confidence logit and its label, the weights);
  `dspark_loss(terms)` combines them: with p_d = softmax of the
  teacher-forced Markov logits and p_t = the target's next-token distribution at the aligned
  position (T = 1), every term weighted exp(-(k-1)/4) and normalised by the weight sum:
  0.1 CE(p_d, x*) + 0.9 sum|p_d - p_t| + 1.0 BCE(c_k, 1 - sum|p_d - p_t| / 2), target detached.
  The sums run over the full vocabulary: p_d is zero outside the draft vocabulary, so the
  target's mass there (from `target_lse`, the log-sum-exp of its full-vocabulary logits) adds
  to the L1 and lowers the acceptance label, which is then exactly the acceptance probability
  1 - TV(p_d, p_t) of rejection sampling. Without `target_lse`, p_t is renormalised on the draft
  vocabulary (an approximation that over-states acceptance by the off-vocabulary mass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.drafters.dflash.model import slot_accuracy, to_draft_ids
from specdecode.drafters.dspark.drafter import DSparkDrafter
from specdecode.drafters.dspark.model import DSpark
from specdecode.errors import SpecDecodeError
from specdecode.models.base import FINAL_NORM
from specdecode.training.methods.dflash import DFlashLoss, DFlashTask


def dspark_terms(
    net: DSpark,
    head_w,
    t2d,
    packed: dict,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor | None = None,
) -> dict:
    """The loss's per-label quantities ([S, A, K] each unless noted): `logits` [S, A, K, Vd] (the
    teacher-forced Markov logits), `y` the draft-vocabulary labels, `ce`, `l1` (= 2 TV over the
    full vocabulary), `c_logit` the confidence head's logit and `acc_target` its label
    1 - TV(p_d, p_t) (detached), `weight` the position weights (0: no label)."""
    h = packed["states"]  # [S, A, K, d]
    prev = to_draft_ids(packed["prev"], t2d)  # teacher forcing: the real token before each label
    logits = net.markov_logits(net.logits(h, head_w).float(), prev)  # [S, A, K, Vd]
    y = to_draft_ids(packed["labels"], t2d)
    Vd = logits.shape[-1]
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
    return {
        "logits": logits,
        "y": y,
        "ce": ce,
        "l1": l1,
        "c_logit": c_logit,
        "acc_target": acc_target,
        "weight": packed["weight"],
    }


def dspark_loss(t: dict) -> tuple[torch.Tensor, dict]:
    """The loss and its logs from `dspark_terms(net, head_w, t2d, packed, target_logits,
    target_lse)` (packed: from `block_batch`; target_logits [S, A, K, Vd]: the target at
    label_pos - 1 on the draft vocabulary; target_lse [S, A, K]: log-sum-exp of its
    full-vocabulary logits there)."""
    w, acc_target = t["weight"], t["acc_target"]
    bce = F.binary_cross_entropy_with_logits(t["c_logit"], acc_target, reduction="none")
    norm = w.sum().clamp(min=1e-6)
    parts = {k: (v * w).sum() / norm for k, v in (("ce", t["ce"]), ("l1", t["l1"]), ("bce", bce))}
    loss = 0.1 * parts["ce"] + 0.9 * parts["l1"] + 1.0 * parts["bce"]
    logs = {f"loss_{k}": float(v.detach()) for k, v in parts.items()} | slot_accuracy(t["logits"], t["y"], w)
    with torch.no_grad():
        m = (w > 0).float()
        exp_acc = (acc_target * m).sum((0, 1)) / m.sum((0, 1)).clamp(min=1)
        for j in (0, 1, 3):
            if j < exp_acc.shape[0]:
                logs[f"accept_{j}"] = float(exp_acc[j])  # E[min(p_d, p_t)] per draft position
    return loss, logs


class DSparkLoss(DFlashLoss):
    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        return dspark_loss(dspark_terms(*self._inputs(batch, feats)))

    def terms(self, batch: dict, feats: dict) -> dict:
        """`dspark_terms` of a batch (what the loss reads; offline evaluation of the heads)."""
        return dspark_terms(*self._inputs(batch, feats))

    def _inputs(self, batch: dict, feats: dict) -> tuple:
        target, head_w, t2d = self._frozen
        dev = batch["input_ids"].device
        packed = self.pack(batch, feats)
        S, A, K = packed["label_pos"].shape
        with torch.no_grad():  # the target's distribution for each label, from the row before it
            final = feats[FINAL_NORM].to(dev)  # [S, T, d]
            T = final.shape[1]
            rows = (packed["label_pos"] - 1).clamp(max=T - 1).view(S, -1)  # [S, A*K]
            flat = (rows + T * torch.arange(S, device=dev)[:, None]).view(-1)
            uniq, inv = torch.unique(flat, return_inverse=True)  # blocks overlap: each row once
            logits_d, lse = target_on_draft_vocab(
                final.reshape(S * T, -1)[uniq], target.model.lm_head, self.net.d2t
            )
            tgt = logits_d[inv].view(S, A, K, -1)  # [S, A, K, Vd]
        return self.net, head_w.to(dev), t2d, packed, tgt, lse[inv].view(S, A, K)


def target_on_draft_vocab(
    h: torch.Tensor,  # [N, d] the target's final normed states
    head,  # [N, d] -> [N, V] fp32: the target's full head (its own formats)
    d2t: torch.Tensor,  # [Vd] long: the draft vocabulary's target ids
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits on the draft vocabulary [N, Vd] and the log-sum-exp of its
    full-vocabulary logits [N], both from one product per row chunk (so p_t = exp(logits - lse)
    is a sub-distribution of one consistent softmax, whatever the head's rounding)."""
    d2t = d2t.to(h.device)
    parts = [head(h[i : i + chunk]) for i in range(0, len(h), chunk)]  # [n, V] each
    return torch.cat([z[:, d2t] for z in parts]), torch.cat([torch.logsumexp(z, dim=-1) for z in parts])


TRAIN_ONLY = (None, "confidence")  # train_only: every weight, or the confidence head alone


class DSparkTask(DFlashTask):
    method = "dspark"
    layout = "dspark"
    loss_cls = DSparkLoss

    def __init__(
        self, target, seqs, block_size: int = 7, markov_rank: int = 256, train_only: str | None = None, **kw
    ):
        super().__init__(target, seqs, block_size=block_size, markov_rank=markov_rank, **kw)
        self.feature_layers = (*self.feature_layers, FINAL_NORM)
        if train_only not in TRAIN_ONLY:
            raise SpecDecodeError(
                f"--train-only must be one of {', '.join(map(str, TRAIN_ONLY))}, got {train_only!r}"
            )
        self.train_only = train_only
        if train_only == "confidence":  # the rest stays as warm-started: no gradient, no update
            for name, p in self.net.named_parameters():
                p.requires_grad_(name.startswith("conf."))

    def after_warm_start(self) -> None:
        """The STS temperatures (and bias) of the checkpoint started from were fitted to its head,
        which this run retrains: back to the uncalibrated ones (`specdecode calibrate` the result)."""
        with torch.no_grad():
            self.net.sts_temperature.fill_(1.0)
            self.net.sts_bias.fill_(0.0)

    def training_meta(self) -> dict:
        return {"train_only": self.train_only} if self.train_only else {}

    def make_net(self, cfg) -> DSpark:
        return DSpark(cfg)

    def make_drafter(self) -> DSparkDrafter:
        return DSparkDrafter(self.net, self.target)
