"""Distilled draft model training task (`specdecode train draft`).

Contract: the drafter is an independent causal LM with its own KV cache (the classic `draft`
method, drafters/draft_model.py), built from the target's config with `num_layers` layers. Its
layers start as copies of target layers spread over the depth (`init_layers`) and its final norm
as the target's; the embedding and the output head are the target's own tensors, shared and
frozen, so a checkpoint stores only the layers and the norm. `DistillTask`: loss =
KL(target || drafter) of the next-token distributions at response tokens, restricted to the
draft vocabulary (the most frequent response tokens) to keep the head products small on CPU;
the drafter still drafts over the full vocabulary.
Legend: B batch, T rows, d width, Vd draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.drafters.draft_model import DraftModelDrafter, _drafter, _embed_weight, small_config
from specdecode.drafters.layers import shifted_kl
from specdecode.models.base import FINAL_NORM
from specdecode.models.loader import open_checkpoint
from specdecode.training.vocab import pick_vocabulary


def init_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """Target layers copied into the drafter: spread evenly, first and last included."""
    if num_layers == 1:
        return [0]
    return [round(i * (num_target_layers - 1) / (num_layers - 1)) for i in range(num_layers)]


class DistillLoss(nn.Module):
    def __init__(self, small, target, d2t: torch.Tensor):
        super().__init__()
        self.small = small  # transformers CausalLM with num_layers layers (trainable but embed/head)
        self._frozen = [target.model.lm_head_weight()[d2t].detach().float()]

    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        w = self._frozen[0].to(batch["input_ids"].device)
        h = self.small.model(input_ids=batch["input_ids"]).last_hidden_state.float()  # [B, T, d] normed
        with torch.no_grad():
            target_logits = feats[FINAL_NORM].float() @ w.T  # [B, T, Vd]
        # Row t predicts token t+1: train where that token is a response token.
        loss, acc = shifted_kl(
            h, target_logits, batch["loss_mask"], batch["lengths"], shift=0, head=lambda x: x @ w.T
        )
        return loss, {"loss_1": float(loss.detach()), "acc_1": float(acc)}


class DistillTask:
    method = "draft"
    feature_layers = (FINAL_NORM,)

    def __init__(self, target, seqs, num_layers: int = 4, draft_vocab_size: int = 8192, d2t=None):
        from transformers import AutoModelForCausalLM  # deferred: importing transformers takes seconds

        info = target.model.info
        self.target, self.num_layers = target, num_layers
        self.layers_from = init_layers(info.num_layers, num_layers)
        cfg = small_config(target.config, num_layers)
        small = AutoModelForCausalLM.from_config(cfg).float()
        # Copy the chosen target layers, the final norm and the embedding (frozen) from the target.
        src = open_checkpoint(target.path)
        pre = "model." if "model.embed_tokens.weight" in src else ""
        state = {}
        for k in small.state_dict():
            if k.startswith("model.layers."):
                i, rest = k[len("model.layers.") :].split(".", 1)
                state[k] = src[f"{pre}layers.{self.layers_from[int(i)]}.{rest}"].float()
            elif k == "model.norm.weight":
                state[k] = src[f"{pre}norm.weight"].float()
        small.load_state_dict(state, strict=False)
        with torch.no_grad():
            small.get_input_embeddings().weight.copy_(_embed_weight(target).float())
        small.get_input_embeddings().weight.requires_grad_(False)
        small.get_output_embeddings().weight.requires_grad_(False)
        small.to(info.device)
        d2t, self.coverage = pick_vocabulary(
            seqs, min(draft_vocab_size, info.vocab_size), target.eos_token_ids, info.vocab_size, d2t
        )
        self.small = small
        self.module = DistillLoss(small, target, d2t)

    def arch(self) -> dict:
        return {"num_layers": self.num_layers, "init_layers": self.layers_from}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {
            k: v
            for k, v in self.small.state_dict().items()
            if k.startswith("model.layers.") or k == "model.norm.weight"
        }

    def make_drafter(self) -> DraftModelDrafter:
        return _drafter(self.target, self.checkpoint_state(), self.num_layers, torch.float32)
