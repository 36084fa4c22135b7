"""Small trainable transformer pieces shared by the learned drafters (EAGLE, MTP, DFlash, ...).

Contract:
- `rope_table(positions, head_dim, theta)` -> (cos, sin) `[..., D]` in fp32 (rotate-half
  convention of Llama/Qwen); `apply_rope(x [B, N, H, D], cos, sin)` rotates q or k.
- `DraftAttention`: grouped-query attention whose projections are trainable; it does not own a
  cache: `qkv(x)` gives (q, k, v) `[B, N, H|Hk, D]` and `out(o)` projects back, so each drafter
  decides what the queries attend to (training-time-test blocks, a per-slot KV cache, a tree).
  With `qk_norm` it has per-head RMSNorms `q_norm` / `k_norm` (weights [D]) applied to q and k
  before RoPE, as Qwen3 does; `kv(x)` gives the keys/values alone (same norm and RoPE).
- `attend(q [B, N, H, D], k [B, M, Hk, D], v, mask [B, N, M] bool or None)` -> `[B, N, H*D]`.
- `SwiGLU`: the Llama MLP. `RMSNorm` is `torch.nn.RMSNorm` (re-exported for one import site);
  `norm_eps(norm)` the epsilon it adds in fp32.
- `use_formats(net, plan)`: for inference, every `nn.Linear` of `net` becomes a `PlannedLinear`
  whose product runs in a `models.formats` plan (the target's measured formats, e.g. bf16 AMX
  tiles for a few rows) instead of a plain fp32 matmul; q/k/v (and k/v alone) and gate/up run
  as one product each and RMSNorm as one fused kernel (`FusedRMSNorm`); parameters and state_dict keys stay;
  `net.formats_plan` is `plan`.
- `target_shape(info, config, draft_vocab_size)`: the architecture fields a drafter copies from
  its target (width, heads, MLP width, vocabularies, norm eps, RoPE base) for its config.
- `draft_to_full_logits(small, d2t, V)`: draft-vocabulary logits -> target-vocabulary logits.
- `DraftVocab(d2t, vocab_size)`: sampling that stays in the draft vocabulary (Vd ids), up to
  the verifier: `probs(small_logits, params)` processes Vd logits (ids the
  tokenizer cannot emit masked), exactly the probabilities processing the full-vocabulary
  logits (-inf off the draft vocabulary) gives, restricted to the draft ids; `argmax` the id
  that processing at temperature 0 keeps; `to_target(ids)`
  maps sampled draft ids (q goes to the verifier over the draft ids: `Proposal.draft_vocab`).
- `shifted_kl(draft, target, loss_mask, lengths, shift, head)`: the distillation loss every
  learned drafter trains with (masked KL to the target's distribution `shift` rows ahead), on
  the loss rows only (`shifted_rows`); `SoftTargets(target_logits)` holds the target's side,
  computed once per step for all the shifts that read it.
- `signed_rope_table(positions, head_dim, theta)` -> `[*positions.shape, 2, D]`: `signed_rope` of
  `rope_table`'s rows, read from one cached table (a round reads rows instead of ~6 small ops);
  `signed_rope_rows(start, n, head_dim, theta, device)` consecutive positions as a view of it.
- `whole_layer_args(attn, mlp, post_norm, rows)`: a drafter layer's products for `kernels`'
  decode_layer (one call a layer at inference; None where its products are not our kernels);
  `signed_rope(cos, sin)` the RoPE table that call reads; `layer_call(...)` that call for one
  request's consecutive new rows of its cache slot.
- `HF_LAYER_NAMES`: a drafter layer's parameter names -> a Hugging Face decoder layer's;
  `QK_NORM_NAMES` the same for the optional per-head q/k norms.
- `DraftConfig`: base of every drafter's architecture dataclass: `to_json()` / `from_json(d)`
  (the checkpoint's config.json "arch"; JSON lists become the tuples the fields declare).
- `ReducedHead`: mixin for a network with a head over the draft vocabulary (`self.head`,
  buffer `self.d2t`): `init_from_target(head_weight, d2t)` starts the head from the target
  head's rows of the draft vocabulary.
Legend: B batch, N query rows, M key rows, H heads, Hk KV heads, D head dim, d model width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models import formats, kernels
from specdecode.models.formats import Product
from specdecode.sampling import process_logits_batch

RMSNorm = nn.RMSNorm

# A drafter decoder layer's parameters -> the same tensors' names in a Hugging Face decoder layer
# (what initialising from the target's layers and the interop layouts read and write).
HF_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
QK_NORM_NAMES = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}


class DraftConfig:
    """Base of a drafter architecture dataclass: JSON round trip for checkpoints."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]):
        tuples = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items()})


class ReducedHead:
    """Mixin for a network whose `head` predicts the draft vocabulary `d2t` (target ids)."""

    head: nn.Linear
    d2t: torch.Tensor

    def init_from_target(self, head_weight: torch.Tensor, d2t: torch.Tensor) -> None:
        """Draft head rows start as the target head's rows of the draft vocabulary."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.head.weight.copy_(head_weight[d2t].float())


_ROPE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (D, theta, device) -> cos/sin [P, D]


def rope_table(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[*positions.shape, D]` (fp32) for integer positions >= 0: rows of one table per
    (D, theta, device), computed once and doubled when a position passes its end (a drafting
    round reads two rows instead of computing ~8 small ops)."""
    key = (head_dim, float(theta), positions.device)
    table = _ROPE.get(key)
    need = int(positions.max()) + 1 if positions.numel() else 0
    if table is None or table[0].shape[0] < need:
        size = max(need, 2 * table[0].shape[0] if table is not None else 4096)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
        ang = torch.arange(size, device=positions.device).float().unsqueeze(-1) * inv  # [P, D/2]
        ang = torch.cat([ang, ang], dim=-1)  # [P, D]
        table = _ROPE[key] = (ang.cos(), ang.sin())
    return table[0][positions], table[1][positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D]; cos/sin [B, N, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * c + rot * s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Masked GQA: q [B, N, H, D], k/v [B, M, Hk, D], mask [B, N, M] (True = visible; None: every
    key visible) -> [B, N, H*D]."""
    B, N, H, D = q.shape
    m = None if mask is None else mask.unsqueeze(1)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, enable_gqa=True
    )  # [B, H, N, D]
    return o.transpose(1, 2).reshape(B, N, H * D)


class DraftAttention(nn.Module):
    def __init__(
        self,
        in_dim: int,
        d: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.H, self.Hk, self.D = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, d, bias=False)
        if qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE (absent: no parameters at all)
            self.q_norm = RMSNorm(head_dim, eps=eps)
            self.k_norm = RMSNorm(head_dim, eps=eps)
        self.qk_norm = qk_norm
        self.fused_qkv: Product | None = None  # [M, in] -> [M, (H + 2Hk) D] (use_formats)
        self.fused_kv: Product | None = None  # [M, in] -> [M, 2 Hk D] (use_formats)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, N, in_dim] -> k, v [B, N, Hk, D] (k normed when qk_norm, then RoPE)."""
        B, N, _ = x.shape
        if self.fused_kv is None:
            k, v = self.k_proj(x).view(B, N, self.Hk, self.D), self.v_proj(x).view(B, N, self.Hk, self.D)
        else:  # one product for both
            k, v = self.fused_kv(x.reshape(B * N, -1)).view(B, N, 2 * self.Hk, self.D).split(self.Hk, dim=2)
        return self._rope_k(k, cos, sin), v

    def _rope_k(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projected keys [B, N, Hk, D] -> normed when qk_norm, then RoPE."""
        return apply_rope(self.k_norm(k) if self.qk_norm else k, cos, sin)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, N, in_dim] -> q [B, N, H, D], k/v [B, N, Hk, D] (RoPE applied to q and k)."""
        B, N, _ = x.shape
        if self.fused_qkv is None:
            q = self.q_proj(x).view(B, N, self.H, self.D)
            k, v = self.kv(x, cos, sin)
        else:  # one product for the three projections
            qkv = self.fused_qkv(x.reshape(B * N, -1)).view(B, N, self.H + 2 * self.Hk, self.D)
            q, k, v = qkv.split([self.H, self.Hk, self.Hk], dim=2)
            k = self._rope_k(k, cos, sin)
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin), k, v


class SwiGLU(nn.Module):
    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.fused_gate_up: Product | None = None  # [M, d] -> [M, 2 inter] (use_formats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gu = self.fused_gate_up(x.reshape(-1, x.shape[-1]))  # [M, 2 inter]
        ops = kernels.fused() if gu.dtype == torch.float32 and gu.device.type == "cpu" else None
        if ops is not None:
            act = ops.silu_mul(gu)
        else:
            inter = gu.shape[-1] // 2
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
        return self.down_proj(act).view(*x.shape[:-1], -1)


def norm_eps(norm: nn.RMSNorm) -> float:
    """The epsilon an fp32 nn.RMSNorm adds (its own, else nn.RMSNorm's default)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


class FusedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose fp32 CPU inference runs our one-pass kernel (models/kernels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.fused()
        if ops is None or x.dtype != torch.float32 or x.device.type != "cpu" or self.weight is None:
            return super().forward(x)
        d = x.shape[-1]
        return ops.rms_norm(x.reshape(-1, d), self.weight, norm_eps(self)).view(x.shape)


class PlannedLinear(nn.Module):
    """A frozen projection whose product runs in a format plan: [.., in] -> [.., out]. Made from
    a weight [out, in] (+ bias), or from an nn.Linear (`of`), whose weight and bias then stay
    parameters, so state_dict keys are unchanged. The plan's copies are made once: later changes
    to the parameters are not seen (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: formats.FormatPlan) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.product = formats.Linear(weight.detach(), None if bias is None else bias.detach(), plan)

    @classmethod
    def of(cls, lin: nn.Linear, plan: formats.FormatPlan) -> PlannedLinear:
        planned = cls(lin.weight, lin.bias, plan)
        planned.weight, planned.bias = lin.weight, lin.bias
        return planned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features))  # [M, out]
        return y.view(*x.shape[:-1], self.out_features)


def signed_rope(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos/sin [.., D] (rotate-half convention) -> [.., 2, D] (cos ; sin with its first half
    negated): the table our fused RoPE kernel reads (x * cos + roll(x, D/2) * signed sin)."""
    half = sin.shape[-1] // 2
    return torch.stack([cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)], dim=-2)


_SIGNED_ROPE: dict[tuple, torch.Tensor] = {}  # (D, theta, device) -> [P, 2, D]


def _signed_table(need: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The cached signed RoPE table [P, 2, D] of (D, theta, device), P >= need."""
    key = (head_dim, float(theta), device)
    table = _SIGNED_ROPE.get(key)
    if table is None or table.shape[0] < need:
        rope_table(torch.tensor([max(need - 1, 0)], device=device), head_dim, theta)  # grows cos/sin
        table = _SIGNED_ROPE[key] = signed_rope(*_ROPE[key])  # [P, 2, D]
    return table


def signed_rope_table(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """`signed_rope(*rope_table(positions, head_dim, theta))`, rows of one cached table."""
    need = int(positions.max()) + 1 if positions.numel() else 0
    return _signed_table(need, head_dim, theta, positions.device)[positions]


def signed_rope_rows(start: int, n: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """`signed_rope_table` of positions start..start+n-1 [n, 2, D]: a view of the cached table."""
    return _signed_table(start + n, head_dim, theta, device)[start : start + n]


def whole_layer_args(attn: DraftAttention, mlp: SwiGLU, post_norm: nn.Module, rows: int) -> tuple | None:
    """(args, norms) for `kernels`' decode_layer: args its arguments after `ln1` up to the down
    product's (products and post-attention norm), norms the per-head q/k norm weights as keyword
    arguments ({} without them), for a drafter layer made of `attn`, `post_norm` and `mlp`, when
    every product of `rows` rows runs one of our compiled kernels (`use_formats` with such a
    plan); else None (the layer then runs its Python modules)."""
    ops = kernels.fused()
    o, down = attn.o_proj, mlp.down_proj
    if ops is None or not hasattr(ops, "decode_layer") or attn.fused_qkv is None:
        return None
    if mlp.fused_gate_up is None or not isinstance(o, PlannedLinear) or not isinstance(down, PlannedLinear):
        return None
    prods = formats.layer_products(
        attn.fused_qkv, o.product, post_norm.weight, mlp.fused_gate_up, down.product, rows
    )
    if prods is None:
        return None
    norms = {"q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight} if attn.qk_norm else {}
    return prods, norms


def layer_call(
    x: torch.Tensor,  # [N, d] the layer's residual input
    ln1: torch.Tensor,  # [d] attention-input norm (unused when qkv_in is given)
    layer_args: tuple,  # whole_layer_args(...) for N rows
    cs: torch.Tensor,  # [N, 2, D] signed_rope table of the new rows' positions
    k: torch.Tensor,  # [1, Hk, R, D] one request's key cache slot (a view: written in place)
    v: torch.Tensor,  # [1, Hk, R, D] its value cache slot
    r0: int,  # the new rows are cache rows r0 .. r0 + N - 1
    cfg,  # num_heads, num_kv_heads, head_dim, rms_norm_eps
    visible: torch.Tensor | None = None,  # [N, r0 + N] bool; None: every row sees rows 0..r0+N-1
    qkv_in: torch.Tensor | None = None,  # [N, in] the attention input itself (EAGLE-3's fused one)
) -> torch.Tensor:
    """`kernels`' decode_layer for one request's N consecutive new rows: writes their keys and
    values at rows r0.., attends over rows 0..r0+N-1 (`visible` repeated over the G query heads
    of a KV head, decode_layer's row order) -> [N, d] the layer's output."""
    args, norms = layer_args
    N = x.shape[0]
    mask = None
    if visible is not None:
        mask = visible.repeat(cfg.num_heads // cfg.num_kv_heads, 1)[None, None]  # [1, 1, G*N, r0+N]
    return kernels.fused().decode_layer(
        x, ln1, *args, cs, k[:, :, r0 : r0 + N].transpose(1, 2), v[:, :, r0 : r0 + N].transpose(1, 2),
        k[:, :, : r0 + N], v[:, :, : r0 + N], mask, cfg.rms_norm_eps,
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qkv_in, **norms,
    )  # fmt: skip


def cpu_plan(target) -> formats.FormatPlan | None:
    """The target's measured format plan when it runs on CPU (where drafters follow it), else None."""
    plan = getattr(target.model, "plan", None)
    return plan if plan is not None and target.model.info.device.type == "cpu" else None


def use_formats(net: nn.Module, plan: formats.FormatPlan) -> nn.Module:
    """Ready a frozen `net` for inference in `plan` (in place; returns `net`): every nn.Linear
    becomes a PlannedLinear, DraftAttention's q/k/v and SwiGLU's gate/up projections become one
    product each, RMSNorms run the fused kernel. Parameters and state_dict keys stay."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, DraftAttention):
                w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
                m.fused_qkv = formats.Linear(w, None, plan)
                m.fused_kv = formats.Linear(w[m.H * m.D :], None, plan)
            elif isinstance(m, SwiGLU):
                w = torch.cat([m.gate_proj.weight, m.up_proj.weight])
                m.fused_gate_up = formats.Linear(w, None, plan)
    _swap(net, plan)
    net.formats_plan = plan  # what the drafter's other products of its own weights follow
    return net


def _swap(net: nn.Module, plan: formats.FormatPlan) -> None:
    for name, child in list(net.named_children()):
        if isinstance(child, nn.Linear):
            setattr(net, name, PlannedLinear.of(child, plan))
        elif type(child) is nn.RMSNorm and child.normalized_shape == (child.normalized_shape[-1],):
            fused = FusedRMSNorm(child.normalized_shape, child.eps, child.elementwise_affine)
            fused.weight = child.weight
            setattr(net, name, fused)
        else:
            _swap(child, plan)


def target_shape(info, config, draft_vocab_size: int) -> dict:
    """Config fields taken from the target (`info`: ModelInfo, `config`: its HF config)."""
    return dict(
        hidden_size=info.hidden_size,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        intermediate_size=getattr(config, "intermediate_size", 4 * info.hidden_size),
        draft_vocab_size=min(draft_vocab_size, info.vocab_size),
        target_vocab_size=info.vocab_size,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
        rope_theta=float(getattr(config, "rope_theta", None) or 10000.0),
    )


def draft_to_full_logits(small: torch.Tensor, d2t: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """[B, Vd] draft-vocabulary logits -> [B, V] fp32 target-vocabulary logits (-inf elsewhere)."""
    full = torch.full((small.shape[0], vocab_rows), float("-inf"), device=small.device)
    return full.index_copy_(1, d2t.to(small.device), small.float())


class DraftVocab:
    """A reduced draft vocabulary: processing and sampling in Vd ids."""

    def __init__(self, d2t: torch.Tensor, vocab_size: int) -> None:
        self.d2t = d2t  # [Vd] target id of each draft id
        off = d2t >= vocab_size  # [Vd] draft ids the tokenizer never emits (padded head rows)
        self.off = off if bool(off.any()) else None

    def _emittable(self, small_logits: torch.Tensor) -> torch.Tensor:  # [..., Vd] fp32
        x = small_logits.float()
        return x if self.off is None else x.masked_fill(self.off.to(x.device), float("-inf"))

    def probs(self, small_logits: torch.Tensor, params: list) -> torch.Tensor:  # [B, N, Vd] -> same
        return process_logits_batch(self._emittable(small_logits), params)

    def argmax(self, small_logits: torch.Tensor) -> torch.Tensor:  # [..., Vd] -> [...] draft ids
        """The greedy draft: the id that processing at temperature 0 puts all its mass on."""
        return self._emittable(small_logits).argmax(dim=-1)

    def log_probs(self, small_logits: torch.Tensor) -> torch.Tensor:  # [..., Vd] -> same, T = 1
        """Log-softmax over the draft ids the tokenizer can emit (for ranking tree candidates)."""
        return torch.log_softmax(self._emittable(small_logits), dim=-1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [...] draft ids -> target ids
        return torch.take(self.d2t.to(draft_ids.device), draft_ids)


class SoftTargets:
    """The target's distribution over the draft vocabulary at every row of a batch, computed
    once per training step for all the shifted losses that read it (fp32, no gradient)."""

    @torch.no_grad()
    def __init__(self, target_logits: torch.Tensor) -> None:  # [B, T, Vd]
        logp = torch.log_softmax(target_logits.float(), dim=-1)
        self.p = logp.exp()  # [B, T, Vd]
        self.neg_entropy = (self.p * logp).sum(-1)  # [B, T]: -H(p), so KL = this - sum p log q
        self.argmax = target_logits.argmax(-1)  # [B, T]


def shifted_rows(loss_mask: torch.Tensor, lengths: torch.Tensor, shift: int) -> tuple[torch.Tensor, ...]:
    """(b, t) [N] each: the rows t whose prediction, the token at t + shift + 1, is a response
    token inside its sequence (loss_mask [B, T], lengths [B])."""
    T = loss_mask.shape[1]
    pos = torch.arange(T, device=loss_mask.device)
    m = F.pad(loss_mask[:, shift + 1 :], (0, shift + 1)).bool()  # [B, T]
    m = m & (pos[None] + shift + 1 < lengths.to(loss_mask.device)[:, None])
    b, t = m.nonzero(as_tuple=True)
    return b, t


def shifted_kl(
    draft: torch.Tensor,  # [B, T, Vd] logits, or [B, T, d] states with `head`
    target: SoftTargets | torch.Tensor,  # the target at each row (or its [B, T, Vd] logits)
    loss_mask: torch.Tensor,  # [B, T] 1 where the token at t is a response token
    lengths: torch.Tensor,  # [B] valid rows
    shift: int,
    head=None,  # [N, d] -> [N, Vd]: applied to the loss rows only
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL(target || drafter) and argmax agreement over the rows that predict a response
    token `shift` rows ahead: row t's draft for the token at t + shift + 1 is checked against the
    target's output at row t + shift. KL = soft CE - H(target): the same gradient as the soft
    cross-entropy, and 0 for a perfect drafter. Only those rows are projected and normalised."""
    soft = target if isinstance(target, SoftTargets) else SoftTargets(target)
    b, t = shifted_rows(loss_mask, lengths, shift)
    if len(b) == 0:  # nothing to learn from this batch at this shift; keep the graph
        return draft.sum() * 0.0, torch.zeros(())
    x = draft[b, t]  # [N, Vd] or [N, d]
    logq = torch.log_softmax((head(x) if head is not None else x).float(), dim=-1)  # [N, Vd]
    ts = t + shift
    kl = soft.neg_entropy[b, ts] - (soft.p[b, ts] * logq).sum(-1)  # [N]
    with torch.no_grad():
        acc = (logq.argmax(-1) == soft.argmax[b, ts]).float().mean()
    return kl.mean(), acc
