"""DFlash training task for the shared trainer (specdecode.training.trainer).

Contract: `DFlashTask(target, seqs, num_layers, block_size, draft_vocab_size, num_anchors,
**arch)` builds a `DFlash` for the target (5 fused feature layers, frozen embedding and head rows
of the draft vocabulary; its layers start from the target's last decoder layers,
`init_from_target`) and a loss module that packs `num_anchors` random blocks per sequence (context
strictly before each anchor) and applies the position-decayed CE on the draft slots. `arch`:
further DFlashConfig fields, e.g. `qk_norm` and `mask_token_id` (on by default, `mask_token_id`
'auto' = `default_mask_token(target)`), the options a checkpoint needs to export to the
speculators layout (docs/interop.md).
`make_drafter()` returns a `DFlashDrafter` over the current weights (served-tau evaluation).

The loss:
- `sample_anchors(loss_mask, lengths, num_anchors)`: random anchors a >= 1 whose next token is a
  response token (uniform, without replacement; the global torch RNG, so the trainer's saved
  RNG state makes a resumed run draw the same anchors).
- `block_batch(net, ctx, embed, input_ids, loss_mask, lengths, num_anchors)`: packs the blocks of
  a training batch and returns their final states plus the aligned labels / weights; the
  weights are exp(-(j-1)/loss_decay) for draft j (1-based), 0 for labels past the sequence or
  outside the response. `dflash_loss` = weighted CE on the draft slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.dflash.drafter import DFlashDrafter
from specdecode.drafters.dflash.model import (
    DFlash,
    DFlashConfig,
    default_decay,
    slot_accuracy,
    t2d_table,
    to_draft_ids,
)
from specdecode.drafters.layers import HF_LAYER_NAMES, QK_NORM_NAMES
from specdecode.models.loader import open_checkpoint
from specdecode.training.vocab import pick_vocabulary


def copy_target_layers(net: DFlash, target, sample: list[list[int]] = ()) -> list[int] | None:
    """Start the drafter's layers (and final norm) from the target's last decoder layers, which
    already map states into the head's space, and the context fusion from the deepest feature
    layer; a short CPU run learns far faster from there than from a random init. With `qk_norm`
    the q/k norms are the target's (Qwen3) or, for a target without them, `qk_norm_gains` fitted
    on `sample` (token id lists). Returns the target layers used, or None when the checkpoint's
    names are not the Llama/Qwen ones (the random init is kept)."""
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
        for ours, theirs in QK_NORM_NAMES.items() if net.cfg.qk_norm else ():
            key = f"{pre}layers.{i}.{theirs}"  # a Qwen3 target has them
            if key in src:
                state[f"layers.{j}.{ours}"] = src[key].float()
    if net.cfg.qk_norm and "layers.0.attn.q_norm.weight" not in state:  # a target without q/k norms
        state |= qk_norm_gains(target, src, pre, ids, sample, net.cfg)
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


def default_mask_token(target) -> int:
    """The id whose embedding the mask slots read when `mask_token_id` is 'auto': the tokenizer's
    mask token, else its unk, pad or (smallest) eos token, the first that is a row of the target's
    embedding. Any fixed row works (the drafter learns around it); a special token keeps it apart
    from text, as z-lab's and speculators' DFlash drafters do."""
    rows = target.model.info.vocab_size
    tok = getattr(target, "tokenizer", None)
    for name in ("mask_token_id", "unk_token_id", "pad_token_id"):
        i = getattr(tok, name, None)
        if isinstance(i, int) and 0 <= i < rows:
            return i
    return min(target.eos_token_ids)


@torch.no_grad()
def qk_norm_gains(target, src, pre: str, ids: list[int], sample, cfg) -> dict[str, torch.Tensor]:
    """Per-channel gains g [D] of the q / k RMSNorms of drafter layer j (a copy of target layer
    ids[j], which has no such norms) that make RMSNorm(q) * g the least-squares fit of q itself
    on the target's own inputs to that layer over `sample`: g_c = sum(q_c^2 / r) / sum(q_c^2 / r^2)
    with r the RMS of each head's q (likewise k). With gains of 1 the copied attention would
    start with unit-RMS queries and keys, far flatter than the target's, and a short run cannot
    move the gains far enough (Adam moves a weight by ~lr a step)."""
    out: dict[str, torch.Tensor] = {}
    seqs = [list(s)[:256] for s in sample if len(s) > 1][:8]
    if not seqs:
        return out
    model = target.model
    layers_in = {i - 1 for i in ids}  # the output of layer i - 1 is the input of layer i
    hs: dict[int, list[torch.Tensor]] = {i: [] for i in layers_in}
    for s in seqs:
        cache = model.new_cache(1, len(s) + 1)
        h = model.forward(torch.tensor([s]), None, cache, [0], logits=False, capture=tuple(layers_in)).hidden
        for i in layers_in:
            hs[i].append(h[i][0].float().cpu())  # [T, d]
    D, eps = cfg.head_dim, cfg.rms_norm_eps
    for j, i in enumerate(ids):
        x = torch.cat(hs[i - 1])  # [T, d]
        x = torch.nn.functional.rms_norm(
            x, (x.shape[-1],), src[f"{pre}layers.{i}.input_layernorm.weight"].float(), eps
        )
        for which, proj in (("q", "q_proj"), ("k", "k_proj")):
            y = x @ src[f"{pre}layers.{i}.self_attn.{proj}.weight"].float().T  # [T, heads * D]
            bias = src.get(f"{pre}layers.{i}.self_attn.{proj}.bias")  # qwen2
            if bias is not None:
                y = y + bias.float()
            y = y.view(-1, D)  # [T * heads, D]
            r = (y.pow(2).mean(-1, keepdim=True) + eps).sqrt()
            g = (y.pow(2) / r).sum(0) / (y.pow(2) / r.pow(2)).sum(0).clamp(min=1e-12)
            out[f"layers.{j}.attn.{which}_norm.weight"] = g
    return out


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int):
    """-> anchors [S, A] long, valid [S, A] bool (A = min(num_anchors, most candidates))."""
    S, T = loss_mask.shape
    pos = torch.arange(T)
    nxt = F.pad(loss_mask[:, 1:], (0, 1)).cpu().bool()  # next token is a response token
    cand = nxt & (pos[None] >= 1) & (pos[None] + 1 < lengths.cpu()[:, None])
    A = max(1, min(num_anchors, int(cand.sum(1).max())))
    anchors = torch.zeros(S, A, dtype=torch.long)
    valid = torch.zeros(S, A, dtype=torch.bool)
    for s in range(S):
        c = cand[s].nonzero()[:, 0]
        pick = c[torch.randperm(len(c))[:A]].sort().values
        anchors[s, : len(pick)], valid[s, : len(pick)] = pick, True
    return anchors, valid


def block_batch(net: DFlash, ctx, embed, input_ids, loss_mask, lengths, num_anchors: int) -> dict:
    """Pack random blocks of a batch (see module docstring). ctx [S, T, d] fused context;
    `embed`: [..] ids -> [.., d] frozen target embedding. Returns dict(states [S, A, Bd, d] of the
    draft slots, labels [S, A, Bd] (target ids), prev [S, A, Bd] (the token before each label),
    label_pos [S, A, Bd], weight [S, A, Bd])."""
    cfg = net.cfg
    dev = ctx.device
    S, T, _ = ctx.shape
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors)
    anchors, valid = anchors.to(dev), valid.to(dev)
    B = cfg.block_size
    pos = torch.arange(T, device=dev)
    ctx_kv = net.context_kv(ctx, pos[None].expand(S, T))
    ctx_visible = pos[None, None] < anchors[:, :, None]  # [S, A, T]: strictly before the anchor
    anchor_ids = torch.gather(input_ids, 1, anchors)  # [S, A]
    emb = net.block_input(embed(anchor_ids).to(ctx.dtype), net.mask_vector(embed))  # [S, A, B, d]
    slot_pos = anchors[:, :, None] + torch.arange(B, device=dev)  # [S, A, B]
    states = net.block_states(emb, slot_pos, ctx_kv, ctx_visible)[:, :, cfg.first_draft_slot :]
    j = torch.arange(cfg.num_drafts, device=dev)  # draft index, 0-based
    label_pos = anchors[:, :, None] + 1 + j  # [S, A, Bd]
    inside = label_pos < lengths.to(dev)[:, None, None]
    lp = label_pos.clamp(max=T - 1).reshape(S, -1)
    labels = torch.gather(input_ids, 1, lp).view_as(label_pos)
    prev = torch.gather(input_ids, 1, (lp - 1)).view_as(label_pos)
    resp = torch.gather(loss_mask, 1, lp).view_as(label_pos).bool()
    decay = torch.exp(-j.float() / cfg.loss_decay)
    weight = decay * (inside & resp & valid[:, :, None]).float()
    return {"states": states, "labels": labels, "prev": prev, "label_pos": label_pos, "weight": weight}


def dflash_loss(net: DFlash, head_w, t2d, packed: dict) -> tuple[torch.Tensor, dict]:
    """Position-decayed CE on the draft slots (labels outside the draft vocabulary are skipped)."""
    logits = net.logits(packed["states"], head_w).float()  # [S, A, Bd, Vd]
    y = to_draft_ids(packed["labels"], t2d)
    w = packed["weight"] * (y < logits.shape[-1]).float()
    ce = F.cross_entropy(logits.flatten(0, 2), y.clamp(max=logits.shape[-1] - 1).flatten(), reduction="none")
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp(min=1e-6)
    return loss, {"loss_ce": float(loss.detach()), **slot_accuracy(logits, y, w)}


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
        d2t=None,
        **arch,
    ):
        info = target.model.info
        if arch.get("mask_token_id") == "auto":
            arch["mask_token_id"] = default_mask_token(target)
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
        d2t, self.coverage = pick_vocabulary(
            seqs, cfg.draft_vocab_size, target.eos_token_ids, info.vocab_size, d2t
        )
        self.net = self.make_net(cfg)
        with torch.no_grad():
            emb = target.model.embed(torch.arange(info.vocab_size, device=info.device)).float().cpu()
        self.net.init_from_target(emb, d2t)
        self.layers_from = (
            copy_target_layers(self.net, target, [q.input_ids.tolist() for q in seqs[:8]])
            if init_from_target
            else None
        )
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
