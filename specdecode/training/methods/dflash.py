"""DFlash training task for the shared trainer (specdecode.training.trainer).

Contract: `DFlashTask(target, seqs, num_layers, block_size, draft_vocab_size, num_anchors)` builds
a `DFlash` for the target (5 fused feature layers, frozen embedding and head rows of the draft
vocabulary; its layers start from the target's last decoder layers, `init_from_target`) and a
loss module that packs `num_anchors` random blocks per sequence (context
strictly before each anchor) and applies the position-decayed CE on the draft slots.
`make_drafter()` returns a `DFlashDrafter` over the current weights (served-tau evaluation).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.drafters.dflash.drafter import DFlashDrafter
from specdecode.drafters.dflash.model import (
    DFlash,
    DFlashConfig,
    block_batch,
    default_decay,
    dflash_loss,
    t2d_table,
)
from specdecode.drafters.layers import HF_LAYER_NAMES
from specdecode.models.loader import open_checkpoint
from specdecode.training.vocab import draft_vocabulary


def copy_target_layers(net: DFlash, target) -> list[int] | None:
    """Start the drafter's layers (and final norm) from the target's last decoder layers, which
    already map states into the head's space, and the context fusion from the deepest feature
    layer; a short CPU run learns far faster from there than from a random init. Returns the
    target layers used, or None when the checkpoint's names are not the Llama/Qwen ones (the
    random init is kept)."""
    src = open_checkpoint(target.path)
    pre = "model." if "model.embed_tokens.weight" in src else ""
    n = target.model.info.num_layers
    ids = list(range(n - len(net.layers), n))
    state = {}
    for j, i in enumerate(ids):
        for ours, theirs in HF_LAYER_NAMES.items():
            key = f"{pre}layers.{i}.{theirs}"
            if key not in src:
                return None
            state[f"layers.{j}.{ours}"] = src[key].float()
    if f"{pre}norm.weight" in src:
        state["norm.weight"] = src[f"{pre}norm.weight"].float()
    # Context = the deepest fused feature, normed like the first copied layer's input: at init
    # that layer's context keys/values are exactly the target's own at those positions.
    d = net.cfg.hidden_size
    fc = torch.zeros(d, len(net.cfg.feature_layers) * d)
    fc[:, -d:] = torch.eye(d)
    state["fc.weight"] = fc
    state["ctx_norm.weight"] = src[f"{pre}layers.{ids[0]}.input_layernorm.weight"].float()
    net.load_state_dict(state, strict=False)
    return ids


class DFlashLoss(nn.Module):
    def __init__(self, net: DFlash, target, num_anchors: int):
        super().__init__()
        self.net, self.num_anchors = net, num_anchors
        info = target.model.info
        head_w = target.model.lm_head_weight()[net.d2t.to(info.device)].detach().float()  # [Vd, d]
        # Frozen target pieces live in a list: not parameters, not buffers (DDP leaves them alone).
        self._frozen = [target, head_w, t2d_table(net.d2t, info.vocab_size)]

    def pack(self, batch: dict, feats: dict) -> dict:
        target = self._frozen[0]
        dev = batch["input_ids"].device
        x = torch.cat([feats[i] for i in self.net.cfg.feature_layers], dim=-1).float().to(dev)  # [S, T, 5d]

        def embed(ids):
            with torch.no_grad():
                return target.model.embed(ids.to(target.model.info.device)).float().to(dev)

        return block_batch(
            self.net,
            self.net.fuse(x),
            embed,
            batch["input_ids"],
            batch["loss_mask"],
            batch["lengths"],
            self.num_anchors,
        )

    def forward(self, batch: dict, feats: dict) -> tuple[torch.Tensor, dict]:
        _, head_w, t2d = self._frozen
        return dflash_loss(self.net, head_w.to(batch["input_ids"].device), t2d, self.pack(batch, feats))


class DFlashTask:
    method = "dflash"
    layout = "dflash"
    loss_cls = DFlashLoss

    def __init__(
        self,
        target,
        seqs,
        num_layers: int = 2,
        block_size: int = 8,
        draft_vocab_size: int = 8192,
        num_anchors: int = 32,
        init_from_target: bool = True,
        **arch,
    ):
        info = target.model.info
        cfg = DFlashConfig.for_target(
            info,
            target.config,
            draft_vocab_size,
            num_layers=num_layers,
            block_size=block_size,
            layout=self.layout,
            loss_decay=default_decay(block_size) if self.layout == "dflash" else 4.0,
            **arch,
        )
        d2t, self.coverage = draft_vocabulary(
            seqs, cfg.draft_vocab_size, target.eos_token_ids, info.vocab_size
        )
        self.net = self.make_net(cfg)
        with torch.no_grad():
            emb = target.model.embed(torch.arange(info.vocab_size, device=info.device)).float().cpu()
        self.net.init_from_target(emb, d2t)
        self.layers_from = copy_target_layers(self.net, target) if init_from_target else None
        self.net.to(info.device)
        self.target = target
        self.module = self.loss_cls(self.net, target, num_anchors)
        self.feature_layers = tuple(dict.fromkeys(cfg.feature_layers))

    def make_net(self, cfg: DFlashConfig) -> DFlash:
        return DFlash(cfg)

    def arch(self) -> dict:
        return self.net.cfg.to_json()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return self.net.state_dict()

    def make_drafter(self) -> DFlashDrafter:
        return DFlashDrafter(self.net, self.target)
