"""NativeDecoder: the llama / qwen2 / qwen3 (and mistral) decoder families in plain PyTorch.

Contract: implements `CausalLM` (models/base.py) exactly as docs/ARCHITECTURE.md states it.
* Built from a transformers config and a name -> tensor mapping of the HF checkpoint
  (`NativeDecoder.from_hf`). Fused weights: one QKV matrix (biases when the checkpoint has them,
  as qwen2 does), one gate/up matrix. Qwen3's q_norm / k_norm are applied per head before RoPE.
* RoPE: `default`, `linear` and `llama3` rope types; anything else is refused with a
  `SpecDecodeError`. cos/sin come from a table precomputed in fp32 exactly as transformers does.
* `forward` writes the new K/V at rows `lengths[slot] + i` and lets new token i see the committed
  rows plus the new rows allowed by `tree_mask` (None = causal). Ragged rows (`num_new`) are
  right-padded; padded tokens produce finite garbage and never leak into valid rows.
* No host-device synchronisation inside `forward`: the step is planned from host-side ints
  (`cache.lengths`, `slots`, `num_new`: pass lists or CPU tensors). A plain decode step of a
  contiguous slot range builds no mask and reads the cache through views; other slots are read
  where they lie too (our kernel takes each row's slot index; SDPA reads the slots' range with
  dummy query rows for the gaps, or gathers the slots when the range is mostly gaps).
* GQA by folding the G query heads of a KV head into the query axis (q [B, Hk, G*N, D]), which
  avoids both expanding K/V and the slow `enable_gqa` path of CPU SDPA.
* On the CPU in fp32 the layer runs on our fused ops (`models/kernels/fused.cpp`: norms, RoPE,
  SiLU-mul and attention for forwards of up to FUSED_ATTENTION_ROWS tokens, each computing a
  row alike whatever the number of rows); elsewhere, or where they cannot be built, on stock
  PyTorch ops. Both compute the same function up to fp32 rounding.
* Matrix products run in the formats of a `FormatPlan` (models/formats.py; `use_formats`),
  which may hold several copies of a weight (e.g. bf16 for one-token steps, fp32 for blocks);
  activations, norms and the KV cache use the plan's `act_dtype`, which is `info.dtype`; `kv_dtype`
  (None by default) gives new caches another dtype: bf16 halves the cache under fp32
  activations (keys and values rounded once as they are written; our attention kernel widens
  them exactly as it reads them, so greedy speculation still equals greedy `ar` token for token). When no
  kernel of the plan multiplies by the fp32 weight itself, the projection masters are kept in
  bf16 where that is exact (a bf16 checkpoint): half the memory, the same products.

Legend: B batch, N new tokens, P prompt length, S cache slots, R = max_len + 1 cache rows,
H heads, Hk KV heads, G = H / Hk, D head dim, d hidden, I intermediate, V head rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.models.base import (
    FINAL_NORM,
    ForwardOutput,
    ModelInfo,
    Segment,
    check_capture,
    chunked_prefill,
    host_list,
)
from specdecode.models.formats import FormatPlan, Linear, bucket_of, forced_plan, layer_products, layers_args
from specdecode.models.host_memory import release_freed_memory
from specdecode.models.kv_cache import KVCache
from specdecode.models.native_spec import NativeSpec

WINDOW_FACTOR = 2  # attend over a slot range in place while it holds at most this many slots per row
FUSED_ATTENTION_ROWS = 64  # forwards of up to this many new tokens per row use our attention kernel


def _sdpa(q, k, v, mask):
    if k.dtype != q.dtype:  # a bf16 KV cache under fp32 activations
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _Layer(nn.Module):
    """Weights of one decoder layer, fused; the math lives in NativeDecoder._layer."""

    def __init__(self, t: dict[str, torch.Tensor | None]) -> None:
        super().__init__()
        for name, value in t.items():
            setattr(self, name, None if value is None else nn.Parameter(value, requires_grad=False))


@dataclass
class _Plan:
    """How one forward writes and reads the cache; built on the host before the layer loop.

    The common case (contiguous slots) keeps two views of the cache buffer, `dst` and `src`, over
    all layers: `decode_layers` takes them whole, the Python layer loop indexes them per layer.
    The others cut per-layer views once per forward (one `unbind` each). Exactly one of dst / k_all
    and one of src / k_span is set.
    """

    s0: int | None  # first slot when the slots are a contiguous range, else None
    slot_idx: torch.Tensor | None  # [B] long (scatter writes; reads by slot or gathered)
    rows: torch.Tensor | None  # [B, N] long write rows; padded rows past the end go to the scratch row
    mask: torch.Tensor | None  # [B|1, 1, G*N, span] bool; None = every query sees all span rows
    # [2, layers, B, N, Hk, D]: where the new keys (dst[0, i]) and values (dst[1, i]) of layer i
    # go (contiguous slots, equal lengths), a view of the cache buffer
    dst: torch.Tensor | None = None
    k_all: tuple | None = None  # layer -> [S, R, Hk, D] whole-cache view for index_put_
    v_all: tuple | None = None
    src: torch.Tensor | None = None  # [2, layers, B, Hk, span, D] view read by attention
    k_span: tuple | None = None  # layer -> [S, Hk, span, D]: read by slot_idx (our kernel) or gathered
    v_span: tuple | None = None
    # Window mode: attention runs over the contiguous slot range [lo, lo + R) read in place
    # (src), the B queries scattered to their rows, gaps getting dummy queries.
    window: torch.Tensor | None = None  # [B] long: row of each request in the range
    window_size: int = 0  # R
    # Fresh causal prefill (every slot empty, contiguous, no tree): SDPA with is_causal over the
    # unfolded heads reads no mask and skips the blocks above the diagonal. Right-padded rows of
    # a ragged batch see their causal prefix instead of everything: garbage either way, never used.
    causal: bool = False


@dataclass
class _Group:
    """One segment of a packed forward: its plan, shape and first row in the packed tokens."""

    plan: _Plan
    B: int
    N: int
    row: int


class NativeDecoder(nn.Module):
    """Compact llama-family decoder implementing `CausalLM` (see module docstring)."""

    def __init__(self, spec: NativeSpec, weights: dict, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Parameter(weights["embed"], requires_grad=False)  # [V, d]
        self.norm = nn.Parameter(weights["norm"], requires_grad=False)  # [d]
        head = None if spec.tie_word_embeddings else weights["head"]
        self.head = None if head is None else nn.Parameter(head, requires_grad=False)  # [V, d]
        self.layers = nn.ModuleList(_Layer(t) for t in weights["layers"])
        # A plain attribute, not a buffer: module.to(dtype) must not round it.
        self._inv_freq = torch.tensor(spec.inv_freq, dtype=torch.float32, device=device)  # [D/2]
        self._rope_len = 0
        self._rope = None
        self.info = ModelInfo(
            arch=spec.model_type,
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            vocab_size=self.embed_tokens.shape[0] if head is None else head.shape[0],
            max_position=spec.max_position,
            dtype=dtype,
            device=device,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
        )
        self._ensure_rope(min(spec.max_position, 8192))
        self.plan = forced_plan("bf16" if dtype == torch.bfloat16 else "fp32", device)  # see use_formats
        self.format_record: dict = {}  # what --dtype auto measured (models/formats.py), if it ran
        self.kv_dtype: torch.dtype | None = None  # KV cache dtype of new caches; None: info.dtype
        self._round_masters = False  # use_formats(keep_masters=False)
        self._refresh()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls,
        config,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> NativeDecoder:
        """Build from a transformers config and the checkpoint's tensors (HF names)."""
        spec = NativeSpec.from_config(config)
        device = torch.device(device)
        pre = "model." if "model.embed_tokens.weight" in tensors else ""

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            return cat([name], required)

        def cat(names: list[str], required: bool = True) -> torch.Tensor | None:
            # Convert each source straight into its rows of one preallocated tensor (one pass).
            missing = [n for n in names if n not in tensors]
            if missing:
                if required:
                    raise SpecDecodeError(
                        f"the checkpoint lacks tensor {missing[0]!r}; is it a {spec.model_type} model?"
                    )
                return None
            parts = [tensors[n] for n in names]
            out = torch.empty(
                (sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, device=device
            )
            row = 0
            for p in parts:
                out[row : row + p.shape[0]].copy_(p)
                row += p.shape[0]
            return out

        layers = []
        for i in range(spec.num_layers):
            a, m = f"{pre}layers.{i}.self_attn.", f"{pre}layers.{i}.mlp."
            t = {
                "ln1": get(f"{pre}layers.{i}.input_layernorm.weight"),  # [d]
                "w_qkv": cat(
                    [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
                ),  # [(H+2Hk)D, d]
                "b_qkv": cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], False),
                "w_o": get(a + "o_proj.weight"),  # [d, H*D]
                "b_o": get(a + "o_proj.bias", False),
                "ln2": get(f"{pre}layers.{i}.post_attention_layernorm.weight"),  # [d]
                "w_gu": cat([m + "gate_proj.weight", m + "up_proj.weight"]),  # [2I, d]
                "b_gu": cat([m + "gate_proj.bias", m + "up_proj.bias"], False),
                "w_down": get(m + "down_proj.weight"),  # [d, I]
                "b_down": get(m + "down_proj.bias", False),
                "qk_norm": None,
            }
            if spec.qk_norm:  # one [H+Hk, D] weight so q and k are normed by one op
                qn, kn = get(a + "q_norm.weight"), get(a + "k_norm.weight")
                t["qk_norm"] = torch.cat([qn.expand(spec.num_heads, -1), kn.expand(spec.num_kv_heads, -1)])
            layers.append(t)
        head = None
        if not spec.tie_word_embeddings:
            head = get("lm_head.weight")
        weights = {"embed": get(f"{pre}embed_tokens.weight"), "norm": get(f"{pre}norm.weight"), "head": head}
        weights["layers"] = layers
        return cls(spec, weights, dtype, device).eval()

    # -- public API -------------------------------------------------------------------------------
    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A cache for `num_slots` requests of up to `max_len` tokens each (prompt + generated)."""
        s = self.spec
        self._ensure_rope(max_len)
        dtype = self.kv_dtype or self.info.dtype
        return KVCache(s.num_layers, num_slots, max_len, s.num_kv_heads, s.head_dim, dtype, self.info.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[..] token ids -> [.., d] embeddings (model dtype)."""
        return F.embedding(input_ids, self.embed_tokens)

    def lm_head_weight(self) -> torch.Tensor:
        """[V, d] the output head (the embedding when tied)."""
        return self.embed_tokens if self.head is None else self.head

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., d] final normed states -> [.., V] fp32 logits."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # [M, d]
        return self._head(flat).view(*hidden.shape[:-1], -1).float()

    def _products(self) -> list[Linear]:
        layers = [lin for layer in self._flat for lin in (layer[1], layer[3], layer[5], layer[6])]
        return layers + [self._head]

    def step_weight_bytes(self) -> int:
        """Bytes of weights one one-token step streams: every product's M = 1 copy."""
        return sum(lin.nbytes(1) for lin in self._products())

    def step_macs(self) -> int:
        """Multiply-adds of one token's products (every layer and the head)."""
        return sum(lin.macs for lin in self._products())

    def use_formats(self, plan: FormatPlan, keep_masters: bool = True) -> None:
        """Run the matrix products in `plan`'s formats; norms, embeddings and the KV cache move
        to its activation dtype (a plain kernel of that dtype reuses the weight without a copy).
        keep_masters=False (the loader's `--dtype auto`: a plan that stays): when every kernel of
        the plan reads bf16-rounded weights, the fp32 projection masters are rounded to bf16 as
        well, exact or not: every product sees the same values, and the fp32 copy goes (6 GB of
        a 1.5B model). A later fp32 plan then multiplies those rounded weights."""
        self.plan = plan
        self._round_masters = not keep_masters
        if self.norm.dtype != plan.act_dtype:
            self.to(plan.act_dtype)  # _apply rebuilds the products
        else:
            self._refresh()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, N] long
        positions: torch.Tensor | None,  # [B, N] long; None = lengths[slot] + i
        cache: KVCache,
        slots: torch.Tensor | Sequence[int],  # [B]
        num_new: torch.Tensor | Sequence[int] | None = None,  # [B]
        tree_mask: torch.Tensor | None = None,  # [B, N, N] bool
        capture: Sequence[int] = (),
        logits: bool = True,  # False: skip the LM head (prefill), ForwardOutput.logits is None
    ) -> ForwardOutput:
        seg = Segment(input_ids, positions, slots, num_new, tree_mask, capture, logits)
        return self.forward_segments(cache, [seg])[0]

    @torch.no_grad()
    def forward_segments(self, cache: KVCache, segments: Sequence[Segment]) -> list[ForwardOutput]:
        """`forward` for several segments on distinct slots at once (`base.forward_packed`): the
        products and norms run over all their T tokens together, attention per segment."""
        s = self.spec
        dev = self.embed_tokens.device
        groups: list[_Group] = []
        ids, pos, taken = [], [], set()
        row = 0
        for g in segments:
            B, N = g.input_ids.shape
            check_capture(g.capture, s.num_layers)
            plan = self._plan(B, N, cache, g.slots, g.num_new, g.tree_mask)
            slot_list = host_list(g.slots)
            if taken.intersection(slot_list):
                raise ValueError(f"segments of one forward must use distinct slots, got {slot_list} twice")
            taken.update(slot_list)
            positions = g.positions
            if positions is None:
                lens = [cache.lengths[x] for x in slot_list]
                positions = torch.tensor(lens).unsqueeze(1) + torch.arange(N)
            ids.append(g.input_ids.reshape(B * N))
            pos.append(positions.reshape(B * N))
            groups.append(_Group(plan, B, N, row))
            row += B * N
        one = len(segments) == 1
        ids_t = (ids[0] if one else torch.cat(ids)).to(dev, non_blocking=True)  # [T]
        pos_t = (pos[0] if one else torch.cat(pos)).to(dev, non_blocking=True)  # [T]
        capture = {int(c) for g in segments for c in g.capture}

        x = F.embedding(ids_t, self.embed_tokens)  # [T, d]: 2D keeps mm calls direct
        cs = self._rope[pos_t]  # [T, 2, D]
        hidden: dict[int, torch.Tensor] = {}
        ops = self._fused
        whole = self._whole_layers(groups, x.shape[0]) if ops is not None else None
        if whole is not None:  # every layer in one call (kernels' decode_layers), same result
            x, hidden = whole(x, cs, [c for c in capture if c != FINAL_NORM])
        else:
            for i, w in enumerate(self._flat):
                if ops is None:
                    x = self._layer(w, x, cs, groups, i)
                else:
                    x = self._layer_fused(ops, w, x, cs, groups, i)
                if i in capture:
                    hidden[i] = x
        if ops is None:
            x = F.rms_norm(x, (s.hidden_size,), self.norm, s.rms_norm_eps)
        else:
            x = ops.rms_norm(x, self.norm, s.rms_norm_eps)
        if FINAL_NORM in capture:
            hidden[FINAL_NORM] = x
        outs = []
        for g, grp in zip(segments, groups, strict=True):
            a, b, shape = grp.row, grp.row + grp.B * grp.N, (grp.B, grp.N, -1)
            xs = x if one else x[a:b]
            hs = {int(c): hidden[int(c)] if one else hidden[int(c)][a:b] for c in g.capture}
            outs.append(
                ForwardOutput(
                    logits=self.lm_head(xs).view(shape) if g.logits else None,
                    hidden={c: h.view(shape) for c, h in hs.items()},
                )
            )
        return outs

    __call__ = forward  # skip nn.Module hook dispatch on the hot path

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, P] long (right-padded when ragged)
        cache: KVCache,
        slots: torch.Tensor | Sequence[int],  # [B]
        num_new: torch.Tensor | Sequence[int] | None = None,  # [B] valid prompt tokens per row
        capture: Sequence[int] = (),
        chunk_size: int = 512,
    ) -> ForwardOutput:
        """Write and COMMIT whole prompts in chunks (see `base.chunked_prefill`)."""
        return chunked_prefill(self, input_ids, cache, slots, num_new, capture, chunk_size)

    # -- internals --------------------------------------------------------------------------------
    def _layer(self, w: tuple, x, cs, groups: list[_Group], i: int) -> torch.Tensor:
        """One decoder layer on x [T, d] (the groups' rows, packed); weights `w` are [in, out]
        views (see `_refresh`); cs [T, 2, D] holds cos and the signed sin per row."""
        s = self.spec
        ln1, qkv_proj, qk_norm, o_proj, ln2, gu_proj, down_proj = w
        T = x.shape[0]
        d, H, Hk, D = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim
        # 1. attention input: fused QKV projection, (qwen3) per-head norm, RoPE on q and k at once
        h = F.rms_norm(x, (d,), ln1, s.rms_norm_eps)
        qkv = qkv_proj(h)  # [T, (H+2Hk)D]
        qk = qkv[:, : (H + Hk) * D].view(T, H + Hk, D)
        v = qkv[:, (H + Hk) * D :].view(T, Hk, D)
        if qk_norm is not None:
            qk = F.rms_norm(qk, (D,), None, s.rms_norm_eps) * qk_norm
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]; the table holds the signed sin.
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # [T, 1, D] each
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # [T, H+Hk, D]
        # 2.-3. cache write and read, attention per group
        o = self._attend_groups(groups, i, qk[:, :H], qk[:, H:], v, lambda N: _sdpa)  # [T, H*D]
        x = x + o_proj(o)
        # 4. SiLU MLP with fused gate/up
        h = F.rms_norm(x, (d,), ln2, s.rms_norm_eps)
        gu = gu_proj(h)  # [T, 2I]
        inter = s.intermediate_size
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [T, I]
        return x + down_proj(act)

    def _layer_fused(self, ops, w: tuple, x, cs, groups: list[_Group], i: int) -> torch.Tensor:
        """`_layer` on our fused fp32 CPU ops (models/kernels/fused.cpp): the same math in a
        third of the operators."""
        s = self.spec
        ln1, qkv_proj, qk_norm, o_proj, ln2, gu_proj, down_proj = w
        T = x.shape[0]
        H, Hk, D = s.num_heads, s.num_kv_heads, s.head_dim
        # 1. attention input: norm, fused QKV projection, (qwen3) per-head norm, RoPE in place
        qkv = qkv_proj(ops.rms_norm(x, ln1, s.rms_norm_eps))  # [T, (H+2Hk)D]
        if qk_norm is not None:  # decode_layer's per-head norms: q's heads, then k's
            qs, ks = qkv[:, : H * D], qkv[:, H * D : (H + Hk) * D]
            qs.copy_(ops.rms_norm(qs.reshape(T * H, D), qk_norm[0], s.rms_norm_eps).view(T, H * D))
            ks.copy_(ops.rms_norm(ks.reshape(T * Hk, D), qk_norm[H], s.rms_norm_eps).view(T, Hk * D))
        ops.rope_(qkv, cs, H + Hk)
        q = qkv[:, : H * D].view(T, H, D)
        k = qkv[:, H * D : (H + Hk) * D].view(T, Hk, D)
        v = qkv[:, (H + Hk) * D :].view(T, Hk, D)
        # 2.-3. cache write and read, attention per group; long prefill chunks go to SDPA's flash
        # kernel, every step and verify block to ours
        o = self._attend_groups(
            groups, i, q, k, v, lambda N: ops.attention if N <= FUSED_ATTENTION_ROWS else _sdpa
        )  # [T, H*D]
        x, h = ops.add_rms_norm(x, o_proj(o), ln2, s.rms_norm_eps)
        # 4. SiLU MLP with fused gate/up
        return x + down_proj(ops.silu_mul(gu_proj(h)))

    def _whole_layers(self, groups: list[_Group], T: int):
        """`(x, cs, capture) -> (x, {layer: x})` running every layer in one `decode_layers` call
        (kernels' decode_layer a layer, looped in C++), when this forward is the case it covers
        (one group on contiguous slots of equal lengths, read in place; attention by our kernel;
        every product of T rows one of our kernels without an output bias), else None. Same
        functions in the same order as `_layer_fused` (Qwen3's per-head q/k norms included)."""
        g = groups[0]
        p = g.plan
        if len(groups) > 1 or p.dst is None or p.src is None or p.window is not None:
            return None
        if g.N > FUSED_ATTENTION_ROWS or (p.causal and g.N > 1) or not hasattr(self._fused, "decode_layers"):
            return None
        bucket = bucket_of(T)
        args = self._layer_args.get(bucket)
        if args is None:
            layers, norms = [], []
            for ln1, qkv, qk_norm, o, ln2, gu, down in self._flat:
                prods = layer_products(qkv, o, ln2, gu, down, T)
                if prods is None:
                    args = False  # cached too: the Python layer serves this bucket
                    break
                layers.append((ln1, prods))
                if qk_norm is not None:  # [H + Hk, D]: q's weight in every q row, k's in every k row
                    norms += [qk_norm[0], qk_norm[self.spec.num_heads]]
            else:
                args = (*layers_args(layers), norms)
            self._layer_args[bucket] = args
        if args is False:
            return None
        s, call = self.spec, self._fused.decode_layers
        ws, ns, bs, norms = args

        def layers(x: torch.Tensor, cs: torch.Tensor, capture: list[int]) -> tuple[torch.Tensor, dict]:
            out = call(
                x,
                ws,
                ns,
                bs,
                cs,
                p.dst,
                p.src,
                p.mask,
                s.rms_norm_eps,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                capture,
                norms,
            )
            return out[0], dict(zip(capture, out[1:], strict=True))

        return layers

    def _attend_groups(self, groups: list[_Group], i: int, q, k, v, attend_for) -> torch.Tensor:
        """Attention of each group over its own slots: q [T, H, D], k, v [T, Hk, D] -> [T, H*D]."""
        outs = []
        for g in groups:
            a, b = g.row, g.row + g.B * g.N
            shape = (g.B, g.N, -1, q.shape[-1])
            outs.append(
                self._attend(
                    g.plan,
                    i,
                    q[a:b].view(shape),
                    k[a:b].view(shape),
                    v[a:b].view(shape),
                    attend_for(g.N),
                    g.B,
                    g.N,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(self, plan: _Plan, i: int, q, k, v, attend, B: int, N: int) -> torch.Tensor:
        """Write layer i's new K/V rows (k, v [B, N, Hk, D]), read the span this step attends to,
        and attend with the G query heads of each KV head folded into the query axis
        (q [B, N, H, D]; `attend(q, keys, values, mask)` is SDPA or our kernel, which also takes
        each row's slot to read the whole cache in place) -> [B*N, H*D]."""
        s = self.spec
        H, Hk, D = s.num_heads, s.num_kv_heads, s.head_dim
        G = H // Hk
        if plan.dst is not None:
            plan.dst[0, i].copy_(k)
            plan.dst[1, i].copy_(v)
        else:
            idx = (plan.slot_idx.unsqueeze(1), plan.rows)
            plan.k_all[i].index_put_(idx, k.to(plan.k_all[i].dtype))
            plan.v_all[i].index_put_(idx, v.to(plan.v_all[i].dtype))
        by_slot = plan.src is None and attend is not _sdpa
        if plan.src is not None:
            keys, values = plan.src[0, i], plan.src[1, i]  # [B, Hk, span, D] views
        elif by_slot:  # our kernel reads row b's slot slot_idx[b] of the whole cache in place
            keys, values = plan.k_span[i], plan.v_span[i]  # [S, Hk, span, D]
        else:
            keys = plan.k_span[i].index_select(0, plan.slot_idx)
            values = plan.v_span[i].index_select(0, plan.slot_idx)
        if plan.causal and attend is _sdpa:  # q [B, N, H, D], keys [B, Hk, N, D]
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            qh = q.transpose(1, 2)  # [B, H, N, D]
            o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, enable_gqa=True)
            return o.transpose(1, 2).reshape(B * N, H * D)  # [B*N, H*D]
        if N == 1:
            q = q.view(B, Hk, G, D)
        else:
            q = q.reshape(B, N, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * N, D)
        if by_slot:
            o = attend(q, keys, values, plan.mask, plan.slot_idx)  # [B, Hk, G*N, D]
        elif plan.window is None:
            o = attend(q, keys, values, plan.mask)  # [B, Hk, G*N, D]
        else:  # the slots' range in place: a few dummy queries instead of copying every K/V row
            qw = q.new_zeros(plan.window_size, *q.shape[1:]).index_copy_(0, plan.window, q)  # [R, ..]
            o = attend(qw, keys, values, plan.mask)[plan.window]
        if N == 1:
            return o.reshape(B, H * D)  # SDPA on CUDA may return it strided
        return o.view(B, Hk, G, N, D).permute(0, 3, 1, 2, 4).reshape(B * N, H * D)

    def _plan(self, B, N, cache: KVCache, slots, num_new, tree_mask) -> _Plan:
        """Plan the cache writes/reads and build the attention mask once for all layers."""
        slot_list = host_list(slots)
        if len(slot_list) != B or len(set(slot_list)) != B:
            raise ValueError(f"slots must hold {B} distinct slot indices, got {slot_list}")
        counts = host_list(num_new)
        if counts is not None and (len(counts) != B or any(not 0 <= n <= N for n in counts)):
            raise ValueError(f"num_new must hold {B} counts in 0..{N}, got {counts}")
        cache.check_room(slot_list, counts or [N] * B)
        window = self.spec.sliding_window
        if window is not None and max(cache.lengths[x] for x in slot_list) + N > window:
            raise SpecDecodeError(
                f"this model uses sliding-window attention ({window} tokens), which NativeDecoder does not "
                f"implement; keep prompt + max_new_tokens <= {window}"
            )
        dev = self.embed_tokens.device
        lens = [cache.lengths[x] for x in slot_list]
        L = lens[0]
        contiguous = slot_list == list(range(slot_list[0], slot_list[0] + B))
        uniform = all(n == L for n in lens) and L + N <= cache.max_len
        span = min(max(lens) + N, cache.max_len)
        kv = cache.kv  # [2, layers, S, Hk, R, D]
        plan = _Plan(slot_list[0] if contiguous else None, None, None, None)
        if contiguous and uniform:
            dst = kv[:, :, slot_list[0] : slot_list[0] + B, :, L : L + N].transpose(
                -2, -3
            )  # [2, ly, B, N, Hk, D]
            plan.dst = dst
        else:
            lens_t = torch.tensor(lens, device=dev)
            plan.slot_idx = torch.tensor(slot_list, device=dev)
            plan.rows = (lens_t.unsqueeze(1) + torch.arange(N, device=dev)).clamp_(max=cache.scratch_row)
            full = kv.transpose(-2, -3)  # [2, layers, S, R, Hk, D]
            plan.k_all, plan.v_all = full[0].unbind(0), full[1].unbind(0)
        lo, hi = min(slot_list), max(slot_list)
        by_slot = self._fused is not None and N <= FUSED_ATTENTION_ROWS  # our kernel reads slots in place
        if contiguous:
            src = kv[:, :, slot_list[0] : slot_list[0] + B, :, :span]  # [2, layers, B, Hk, span, D]
            plan.src = src
        elif not by_slot and hi - lo + 1 <= WINDOW_FACTOR * B:
            # SDPA: reading the slots' range in place (with dummy queries for the gaps) beats
            # copying every row of every layer's K/V (index_select) unless the range is mostly gaps.
            src = kv[:, :, lo : hi + 1, :, :span]  # [2, layers, R, Hk, span, D]
            plan.src = src
            plan.window = torch.tensor([x - lo for x in slot_list], device=dev)
            plan.window_size = hi - lo + 1
        else:  # our kernel reads each row's slot where it lies (no copy, no dummy rows); SDPA gathers
            src = kv[:, :, :, :, :span]  # [2, layers, S, Hk, span, D], by plan.slot_idx
            plan.k_span, plan.v_span = src[0].unbind(0), src[1].unbind(0)
        plan.causal = contiguous and uniform and L == 0 and N > 1 and tree_mask is None
        if not (N == 1 and uniform and tree_mask is None):
            plan.mask = self._mask(B, N, span, torch.tensor(lens, device=dev), counts, tree_mask, dev)
            if plan.window is not None:  # (SDPA) dummy rows see key 0 only: finite garbage,
                # never used
                dummy = torch.zeros(plan.window_size, *plan.mask.shape[1:], dtype=torch.bool, device=dev)
                dummy[..., 0] = True
                plan.mask = dummy.index_copy_(0, plan.window, plan.mask)
        return plan

    def _mask(self, B, N, span, lens_t, counts, tree_mask, dev) -> torch.Tensor:
        """[B, 1, G*N, span] bool: committed rows, plus new rows by tree_mask (or causally)."""
        rel = torch.arange(span, device=dev).view(1, 1, span) - lens_t.view(B, 1, 1)  # [B, 1, span]
        qi = torch.arange(N, device=dev).view(1, N, 1)  # [1, N, 1]
        if tree_mask is None:
            new_ok = rel <= qi  # [B, N, span]
        else:
            tm = tree_mask.to(device=dev, dtype=torch.bool)  # [B, N, N]
            new_ok = torch.gather(tm, 2, rel.clamp(0, N - 1).expand(B, N, span)) | (rel == qi)
        new_ok = new_ok & (rel >= 0) & (rel < N)
        if counts is not None:
            n_t = torch.tensor(counts, device=dev).view(B, 1, 1)
            new_ok = new_ok & (rel < n_t)
            # A padded query sees everything: garbage, but never a row without keys (NaN).
            new_ok = new_ok | (qi >= n_t)
        mask = (rel < 0) | new_ok  # [B, N, span]
        G = self.spec.num_heads // self.spec.num_kv_heads
        return mask.unsqueeze(1).repeat(1, 1, G, 1)  # [B, 1, G*N, span], query index g*N + n

    def _ensure_rope(self, length: int) -> None:
        """Table [length, 2, D] of cos and signed sin in the model dtype (fp32 math, as transformers)."""
        if length <= self._rope_len:
            return
        inv = self._inv_freq  # [D/2] fp32
        freqs = torch.arange(length, device=inv.device, dtype=torch.int64).float()[:, None] * inv[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # [length, D/2]
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)
        self._rope = table.to(self.info.dtype)  # [length, 2, D]
        self._rope_len = length

    def _refresh(self) -> None:
        """Per-layer tuples of norms and `Linear` products in the current plan's formats."""
        plan = self.plan
        self._flat, self._head = [], None  # the old products may hold the old masters: drop them first
        if plan.keeps_fp32_weights and plan.act_dtype == torch.float32:
            self._masters_to(torch.float32)  # the fp32 kernels multiply by the masters themselves
        elif not plan.keeps_fp32_weights and self.embed_tokens.device.type == "cpu":
            # every product holds its own copy; inexact masters only when no product reads them
            self._masters_to(torch.bfloat16, exact=not (self._round_masters and plan.bf16_weights))
        self._flat = [
            (
                w.ln1,
                Linear(w.w_qkv, w.b_qkv, plan),
                w.qk_norm,
                Linear(w.w_o, w.b_o, plan),
                w.ln2,
                Linear(w.w_gu, w.b_gu, plan),
                Linear(w.w_down, w.b_down, plan),
            )
            for w in self.layers
        ]
        self._head = Linear(self.lm_head_weight(), None, plan)
        self._layer_args: dict[int, tuple | bool] = {}  # bucket -> decode_layers' weights and ints
        self.info = replace(self.info, format=plan.name)
        cpu_fp32 = plan.act_dtype == torch.float32 and self.embed_tokens.device.type == "cpu"
        self._fused = kernels.fused() if cpu_fp32 else None  # None: the stock-PyTorch layer

    def _masters_to(self, dtype: torch.dtype, exact: bool = True) -> None:
        """Hold the projection weights' masters in `dtype` where that is exact: bf16 for a bf16
        checkpoint when the plan's products hold their own copies (2 bytes a parameter saved,
        3 GB for a 1.5B model; a later plan rebuilds from the same values), fp32 again when an
        fp32 kernel multiplies by the master itself. exact=False rounds fp32 masters to bf16 even
        where that changes them (use_formats' keep_masters). Norms, embedding and head stay."""
        changed = False
        for layer in self.layers:
            for name in ("w_qkv", "w_o", "w_gu", "w_down"):
                p = getattr(layer, name)
                if p.dtype == dtype or p.dtype not in (torch.float32, torch.bfloat16):
                    continue
                new = p.data.to(dtype)
                if dtype == torch.float32 or not exact or torch.equal(new.float(), p.data):
                    p.data, changed = new, True
        if changed and dtype == torch.bfloat16:
            release_freed_memory()

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() rebuild the RoPE table on the new device/dtype and update info.
        out = super()._apply(fn, recurse)
        n = self._rope_len
        p = self.embed_tokens
        self.info = _replace_info(self.info, p.dtype, p.device)
        self._inv_freq = self._inv_freq.to(p.device)
        self._rope_len = 0
        self._ensure_rope(n)
        if self.plan.act_dtype != p.dtype or p.device.type != "cpu":
            # A plain .to(dtype/device) means that one format (the CPU kernels stay on the CPU).
            self.plan = forced_plan("bf16" if p.dtype == torch.bfloat16 else "fp32", p.device)
        self._refresh()
        return out


def _replace_info(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> ModelInfo:
    return replace(info, dtype=dtype, device=device)
