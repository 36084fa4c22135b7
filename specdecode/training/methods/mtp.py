"""MTP training tasks for the shared trainer: frozen-target and native (joint) modes.

Contract:
- `MTPTask(target, seqs, num_modules, draft_vocab_size)` (mode "frozen") builds `MTP` (modules
  sized like one target layer; draft vocabulary = the most frequent response tokens) and a loss
  module that reads the frozen target's final normed state h^0, from which it also computes the
  soft labels.
- `MTPNativeTask(target, seqs, ..., mtp_weight=0.3, trunk_lr_scale=0.01)` (mode "native",
  DeepSeek-V3's joint training): a trainable copy of the target (transformers, fp32) and the
  modules learn together on L = L_main + lambda * L_MTP, L_main the next-token cross-entropy
  over the response tokens, L_MTP the frozen mode's loss on the trunk's own (detached) soft
  labels; the MTP gradient reaches the trunk through h^0. The trunk learns at
  trunk_lr_scale x the modules' rate. Every save also writes the jointly trained target as a
  Hugging Face directory `<out>/target` (fp32 safetensors + tokenizer): serve the drafter with
  that target. Evaluation runs the real loop on it.
- `response_nll(model, seqs)`: mean next-token NLL of a transformers causal LM over response
  tokens (exp = perplexity), for comparing a jointly trained target with the original.

The loss:
- `mtp_loss(...)`: lambda/D * sum_k KL(target || module k) over response tokens, where the
  target's distribution for t_{i+k+1} is its logits at position i+k (self-distillation). With
  a frozen target only the modules learn (mode "frozen"); "native" joint training adds the
  target's own next-token loss and trains the trunk too (training/methods/mtp.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.layers import SoftTargets, shifted_kl, target_shape
from specdecode.drafters.mtp.drafter import MTPDrafter
from specdecode.drafters.mtp.model import MTP, MTPConfig, mtp_forward
from specdecode.errors import SpecDecodeError
from specdecode.models.base import FINAL_NORM
from specdecode.models.loader import load_model
from specdecode.training.data import collate, plan_batches
from specdecode.training.vocab import pick_vocabulary


def mtp_loss(model: MTP, embed, h0, target_logits, input_ids, loss_mask, lengths, weight: float = 1.0):
    """(lambda / D) sum_k KL at each depth; returns (loss, logs)."""
    total, logs = 0.0, {}
    outs = mtp_forward(model, embed, h0, input_ids, lengths)
    soft = SoftTargets(target_logits)  # once for all the depths
    for k, h in enumerate(outs, start=1):
        # Module k at row i predicts t_{i+k+1}; the target's distribution for it sits at row i+k.
        step, acc = shifted_kl(h, soft, loss_mask, lengths, shift=k, head=lambda x, k=k: model.logits(k, x))
        total = total + step
        logs[f"loss_{k}"], logs[f"acc_{k}"] = float(step.detach()), float(acc)
    return weight * total / len(outs), logs


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

    def __init__(self, target, seqs, num_modules: int = 3, draft_vocab_size: int = 8192, d2t=None):
        info, config = target.model.info, target.config
        cfg = MTPConfig(**target_shape(info, config, draft_vocab_size), num_modules=num_modules)
        d2t, self.coverage = pick_vocabulary(
            seqs, cfg.draft_vocab_size, target.eos_token_ids, info.vocab_size, d2t
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


def _attention_mask(batch: dict) -> torch.Tensor:
    T = batch["input_ids"].shape[1]
    return (torch.arange(T, device=batch["lengths"].device)[None] < batch["lengths"][:, None]).long()


def _next_token_nll(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL of each response token given its prefix, and the number of such tokens."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    m = mask[:, 1:].float() * _attention_mask(batch)[:, 1:].float()  # [B, T-1]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
    return (nll * m).sum(), m.sum()


@torch.no_grad()
def response_nll(model, seqs: list, tokens_per_batch: int = 4096) -> float:
    """Mean NLL per response token of a transformers causal LM over `seqs` (training.data)."""
    model.eval()
    dev = next(model.parameters()).device
    total, count = 0.0, 0.0
    for idx in plan_batches([len(s.input_ids) for s in seqs], tokens_per_batch, seed=0, epoch=0):
        batch = {k: v.to(dev) for k, v in collate([seqs[j] for j in idx]).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=_attention_mask(batch)).logits
        s, c = _next_token_nll(logits, batch)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


class MTPNativeLoss(nn.Module):
    def __init__(self, trunk, net: MTP, mtp_weight: float):
        super().__init__()
        self.trunk, self.net, self.mtp_weight = trunk, net, mtp_weight

    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        out = self.trunk(
            input_ids=batch["input_ids"], attention_mask=_attention_mask(batch), output_hidden_states=True
        )
        s, c = _next_token_nll(out.logits, batch)
        main = s / c.clamp(min=1.0)
        h0 = out.hidden_states[-1].float()  # [B, T, d] final normed state (the head's input)
        self.net.attach_head(self.trunk.get_output_embeddings().weight)  # the trunk's current head
        with torch.no_grad():
            tgt = h0.detach() @ self.net._head[0].to(h0.dtype).T  # [B, T, Vd]
        embed = self.trunk.get_input_embeddings()
        loss, logs = mtp_loss(
            self.net,
            lambda ids: embed(ids).float(),
            h0,
            tgt,
            batch["input_ids"],
            batch["loss_mask"],
            batch["lengths"],
            weight=self.mtp_weight,
        )
        logs["main_nll"] = float(main.detach())
        return main + loss, logs


class MTPNativeTask(MTPTask):
    """Joint training of the target and the MTP modules (see module docstring)."""

    feature_layers = ()  # the trunk runs inside the loss, with gradients

    def __init__(
        self,
        target,
        seqs,
        num_modules: int = 3,
        draft_vocab_size: int = 8192,
        mtp_weight: float = 0.3,
        trunk_lr_scale: float = 0.01,
        out_dir: str | None = None,
        d2t=None,
    ):
        from transformers import AutoModelForCausalLM  # deferred: importing transformers takes seconds

        super().__init__(target, seqs, num_modules=num_modules, draft_vocab_size=draft_vocab_size, d2t=d2t)
        if out_dir is None:
            raise SpecDecodeError("native MTP training needs the output directory (for the new target)")
        if not mtp_weight > 0:
            raise SpecDecodeError(f"--mtp-weight must be > 0, got {mtp_weight}")
        self.trunk = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32)
        self.trunk.to(target.model.info.device)
        self.trunk.config.use_cache = False
        self.mtp_weight, self.trunk_lr_scale = mtp_weight, trunk_lr_scale
        self.target_dir = Path(out_dir) / "target"
        self.module = MTPNativeLoss(self.trunk, self.net, mtp_weight)
        self._eval_target = None

    def training_meta(self) -> dict:
        return {
            "mode": "native",
            "mtp_weight": self.mtp_weight,
            "trunk_lr_scale": self.trunk_lr_scale,
            "target_checkpoint": str(self.target_dir),
        }

    def param_groups(self) -> list[dict]:
        return [
            {"params": list(self.net.parameters()), "lr_scale": 1.0},
            {"params": list(self.trunk.parameters()), "lr_scale": self.trunk_lr_scale},
        ]

    def save_extra(self) -> None:
        """Write the jointly trained target as a Hugging Face directory (atomically)."""
        tmp = self.target_dir.with_name(self.target_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.trunk.config.use_cache = True  # as served; training runs without the cache
        self.trunk.save_pretrained(str(tmp))
        self.trunk.config.use_cache = False
        self.target.tokenizer.save_pretrained(str(tmp))
        gen = Path(self.target.path) / "generation_config.json"
        if gen.is_file() and not (tmp / gen.name).exists():
            shutil.copy(gen, tmp / gen.name)
        old = self.target_dir.with_name(self.target_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.target_dir.exists():
            os.replace(self.target_dir, old)
        os.replace(tmp, self.target_dir)
        shutil.rmtree(old, ignore_errors=True)

    def eval_target(self):
        """The current trunk in the native runtime (for the served-tau evaluation)."""
        self.save_extra()
        info = self.target.model.info
        self._eval_target = load_model(str(self.target_dir), dtype=info.dtype, device=str(info.device))
        return self._eval_target

    def make_drafter(self) -> MTPDrafter:
        target = self._eval_target or self.target
        drafter = MTPDrafter(self.net, target)
        self.net.attach_head(self.trunk.get_output_embeddings().weight)  # keep fp32 for training
        return drafter
