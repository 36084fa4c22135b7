"""Weight formats for the native runtime's matrix products, chosen by measurement.

Contract:
* A *kernel* (`KERNELS`) turns one weight [out, in] (+ bias [out]) into a product
  `fn(x [M, in]) -> [M, out]` that returns x's dtype whatever it computes in:
  - `fp32`: torch.mm on a transposed view of an fp32 weight (no copy of an fp32 master);
  - `bf16`: the same on a bf16 copy (x is cast in, the result cast back);
  - `bf16-up`: bf16 weights multiplied in fp32 (upcast per product): what a forced bf16 model
    uses on CPU for prefill-sized products, where bf16 GEMM may have no fast kernel;
  - `fp32-mkl`, `fp32-onednn`, `bf16-onednn`: weights pre-packed once for MKL's or oneDNN's
    GEMM (what inductor's CPU weight freezing does; private ops, wrapped here in one place; a
    CPU whose oneDNN refuses a packing, e.g. bf16 without AVX-512, simply lacks that kernel);
  - `bf16w`: bf16 weights, fp32 activations and accumulation, our own AVX2 kernel
    (`models/kernels/bf16w.cpp`): half the bytes of fp32 per product at fp32 arithmetic, for
    CPUs whose bf16 GEMMs are slow; absent where it cannot be built;
  - `bf16-amx`: bf16 weights and activations (x rounded to bf16 per product), fp32
    accumulation, on AMX tiles (`models/kernels/amx.cpp`): up to 16 rows cost what one costs;
    absent where the CPU or the OS gives no AMX, or PyTorch's CPU capability is capped below
    AVX-512 (`kernels.barred`: how the AVX2 kind is emulated);
  - `bf16-dp`: the same arithmetic on AVX512-BF16 dot-product instructions
    (`models/kernels/bf16dp.cpp`), for CPUs that have those but no AMX; absent elsewhere;
    `bf16-dp1` the same packing and bits, up to 16 rows in one pass read as one memory stream
    instead of 3-4 (which reads faster depends on the CPU, see bf16dp.cpp: timing picks);
  - `int8` (weight-only, one scale per output row) and `int4` (weight-only, groups of 32,
    asymmetric), PyTorch's own CPU kernels, and `int8w`, the same int8 weights in our AVX2
    kernel beside `bf16w` (widened to fp32 in registers, fp32 accumulation; decode_layer's
    kind 3). They change the model: never chosen by `auto`.
    `int8-bf16` / `int4-bf16`: the same quantized weights with activations rounded to bf16 per
    product (PyTorch's kernels have fast paths for bf16 activations on some CPUs and not for
    fp32 ones: 4-18x on the AMX kind).
* A `FormatPlan` maps the number of rows M of a product to a kernel: bucket i covers
  M <= `BUCKETS[i]` (the last bucket covers everything larger). One-token steps and
  multi-token verification may so use different copies of the same weights; their results
  differ by rounding only (like bf16 batch effects). `act_dtype` is the dtype activations and
  the KV cache use: bf16 when every kernel of the plan computes in bf16, else fp32.
  `keeps_fp32_weights`: False when every kernel holds its own copy of the weight (the masters
  may then be bf16, see NativeDecoder); `bf16_weights`: every kernel reads the weights rounded
  to bf16.
* `auto_plan(shapes, num_layers, device)` measures the candidate kernels on the model's own
  matrix shapes (random weights, several layers so they do not fit in cache), picks the
  kernel per bucket from as few kernels as possible, at most two (each holds its own copy of
  the weights: a kernel already in the plan serves a bucket where it is within 10 % of the
  fastest), and
  caches the measurement and the plan as JSON under
  `<cache_dir>/formats/`, keyed by torch version, CPU capability, CPU model, thread count, the
  shapes and the sources of our own kernels. No CPU flag is read to decide: a kernel that is
  slow or refused here loses. A measurement taken while other work shared the cores is
  provisional: the next loads measure again and the quietest one stays
  (`specdecode.measured`).
* `forced_plan(name)` gives one format everywhere (`fp32`, `bf16`, `int8`, `int4`).
  `quantized_plan(name, shapes, head, num_layers, device)` is what `--dtype int8|int4` loads:
  the one of `QUANTIZED_CANDIDATES[name]` (the same weights, activations in fp32 or bf16) whose
  products of up to `DECODE_ROWS` rows (decoding and verification) take the least time here,
  measured and cached like `auto_plan`. One kernel for every bucket: a quantized target then
  rounds alike at every number of rows, so greedy speculation equals greedy `ar` on it.
* `int8_drafter_plan(base, shapes, device)`: an int8-stored drafter's plan, `int8w` wherever it
  is measured faster than `base` (the target's plan) on products of up to `DRAFT_ROWS` rows of
  the drafter's shapes (cached). `int8_quantize(w)` is the one int8 quantization every int8
  format and the drafters' int8 storage use.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdecode.assets import cache_dir
from specdecode.errors import SpecDecodeError
from specdecode.measured import cached_measurement, cpu_model
from specdecode.models import kernels

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)  # rows M of a product: one step ... prefill, training
LARGE = 256  # buckets past this one are timed on the layers only, with the kernels still in the race
# our compiled products, in decode_layer's kind order
OURS = ("bf16w", "bf16-amx", "bf16-dp", "int8w", "bf16-dp1")
_OURS_AUTO = ("bf16w", "bf16-amx", "bf16-dp", "bf16-dp1")  # ours that `auto` races (int8w changes the model)
AUTO_CANDIDATES = ("fp32", "bf16", "fp32-mkl", "fp32-onednn", "bf16-onednn", *_OURS_AUTO)
FORCED = ("fp32", "bf16", "int8", "int4")
# `--dtype int8|int4`: the same quantized weights with activations in fp32 or in bf16
QUANTIZED_CANDIDATES = {"int8": ("int8", "int8-bf16", "int8w"), "int4": ("int4", "int4-bf16")}
DECODE_ROWS = 16  # `quantized_plan` picks its kernel on products of up to this many rows
DRAFT_ROWS = 64  # `int8_drafter_plan` times the drafter's products of up to this many rows
INT4_GROUP = 32
_BF16 = {"bf16", "bf16-onednn", "bf16-up"}
# kernels that read the weights rounded to bf16
_BF16_WEIGHTS = _BF16 | {"bf16w", "bf16-amx", "bf16-dp", "bf16-dp1"}
_MULTIPLY_BY_MASTER = {"fp32", "fp32-mkl"}  # kernels whose product uses the fp32 weight itself
_MEASURE_LAYERS = 4  # layers of random weights per measurement (well past the L2/L3 caches)
PLAN_SLACK = 1.10  # a kernel already in the plan serves a bucket if within 10 % of the fastest
MAX_COPIES = 2  # kernels (copies of every weight) in one plan: a 1.5B model's bf16 copy is 3 GB

Product = Callable[[torch.Tensor], torch.Tensor]


# ---- kernels ----------------------------------------------------------------------------------
def _reads(fn: Product, *tensors: torch.Tensor) -> Product:
    """Tag a product with the bytes of weights it streams per call (bandwidth ceilings)."""
    fn.nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return fn


def _plain(dtype: torch.dtype):
    def prepare(w: torch.Tensor, b: torch.Tensor | None) -> Product:
        wt = w.to(dtype).t()  # [in, out] view: torch.mm reads it as a transposed operand
        bb = None if b is None else b.to(dtype)

        def fn(x: torch.Tensor) -> torch.Tensor:
            a = x.to(dtype)
            y = torch.mm(a, wt) if bb is None else torch.addmm(bb, a, wt)
            return y.to(x.dtype)

        return _reads(fn, wt)

    return prepare


def _bf16_up(w: torch.Tensor, b: torch.Tensor | None) -> Product:
    wt = w.to(torch.bfloat16).t()  # [in, out] view
    bb = None if b is None else b.float()

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.mm(x.float(), wt.float())
        return (y if bb is None else y + bb).to(x.dtype)

    return _reads(fn, wt)


def _mkl_fp32(w: torch.Tensor, b: torch.Tensor | None) -> Product:
    w = w.float().contiguous()
    bb = None if b is None else b.float()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x.float(), packed, w, bb, x.shape[0]).to(x.dtype)

    return _reads(fn, w)


def _onednn(dtype: torch.dtype):
    def prepare(w: torch.Tensor, b: torch.Tensor | None) -> Product:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous(), 1)
        bb = None if b is None else b.to(dtype)

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, bb, "none", [], "").to(x.dtype)

        return _reads(fn, w.to(dtype))

    return prepare


def _bf16(w: torch.Tensor) -> tuple[torch.Tensor]:
    return (w.to(torch.bfloat16),)


def _ours(kernel: str, pack: str, linear: str, narrow: Callable = _bf16):
    """One of our compiled products (`models/kernels`): the weight packed once by
    `ops.<pack>(*narrow(w))` (bf16 weights; int8w: the int8 weights and scales of
    `int8_quantize`), fp32 x in and out (`ops.<linear>`), other dtypes converted around it."""

    def prepare(w: torch.Tensor, b: torch.Tensor | None) -> Product:
        ops = kernels.fused()
        if ops is None:
            raise RuntimeError(kernels.unavailable.get("cpu", f"the {kernel} kernel is unavailable"))
        why = kernels.barred(pack)
        if why:
            raise RuntimeError(why)
        n = w.shape[0]
        packed = getattr(ops, pack)(*narrow(w))
        bb = None if b is None else b.float()
        op = getattr(ops, linear)

        def fn(x: torch.Tensor) -> torch.Tensor:
            if x.dtype == torch.float32:  # the usual case: no conversion ops to dispatch
                return op(x, packed, n, bb)
            return op(x.float(), packed, n, bb).to(x.dtype)

        fn.ours = (OURS.index(kernel), packed, n, bb)  # what kernels' decode_layer calls directly
        return _reads(fn, packed)

    return prepare


def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w [out, in] -> (q int8 [out, in], scale fp32 [out]) with
    w ~= q * scale[:, None], scale = max |row| / 127 (what every int8 format here and the int8
    storage of drafter checkpoints use: re-quantizing fp32 q * scale gives q back)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


def _int8(act: torch.dtype):
    """Weight-only int8 (one scale per output row), activations in `act` per product."""

    def prepare(w: torch.Tensor, b: torch.Tensor | None) -> Product:
        q, scale = int8_quantize(w)  # [out, in], [out]
        scale = scale.to(act)
        bb = None if b is None else b.float()

        def fn(x: torch.Tensor) -> torch.Tensor:
            y = torch.ops.aten._weight_int8pack_mm(x.to(act), q, scale).float()
            return (y if bb is None else y + bb).to(x.dtype)

        return _reads(fn, q, scale)

    return prepare


def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] int32 in 0..15, scales_and_zeros [in/group, out, 2]) such that
    w ~= (q - 8) * scale + zero, the layout `_weight_int4pack_mm_for_cpu` expects."""
    out, inp = w.shape
    if inp % group:
        raise SpecDecodeError(f"int4 needs input widths divisible by {group}; this model has {inp}")
    g = w.float().reshape(out, inp // group, group)
    lo, hi = g.amin(-1), g.amax(-1)  # [out, in/group]
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out, inp)
    zero = lo + 8 * scale  # the value of q == 8
    return q, torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


def _int4(act: torch.dtype):
    """Weight-only int4 (groups of 32, asymmetric), activations in `act` per product."""

    def prepare(w: torch.Tensor, b: torch.Tensor | None) -> Product:
        q, sz = int4_quantize(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = sz.to(act)
        bb = None if b is None else b.float()

        def fn(x: torch.Tensor) -> torch.Tensor:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act), packed, INT4_GROUP, sz).float()
            return (y if bb is None else y + bb).to(x.dtype)

        return _reads(fn, packed, sz)

    return prepare


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], Product]] = {
    "fp32": _plain(torch.float32),
    "bf16": _plain(torch.bfloat16),
    "bf16-up": _bf16_up,
    "fp32-mkl": _mkl_fp32,
    "fp32-onednn": _onednn(torch.float32),
    "bf16-onednn": _onednn(torch.bfloat16),
    "bf16w": _ours("bf16w", "bf16w_pack", "bf16w_linear"),  # packed [ceil(out/16), in, 16]
    # packed [ceil(out/32), ceil(in/32), 2, 16, 16, 2]
    "bf16-amx": _ours("bf16-amx", "bf16amx_pack", "bf16amx_linear"),
    "bf16-dp": _ours("bf16-dp", "bf16dp_pack", "bf16dp_linear"),  # packed [ceil(out/16), ceil(in/2), 16, 2]
    # the same packing, up to 16 rows read as one stream (which of the two is faster depends on the CPU)
    "bf16-dp1": _ours("bf16-dp1", "bf16dp_pack", "bf16dp1_linear"),
    "int8w": _ours("int8w", "int8w_pack", "int8w_linear", int8_quantize),  # packed [ceil(out/16), in + 4, 16]
    "int8": _int8(torch.float32),
    "int8-bf16": _int8(torch.bfloat16),
    "int4": _int4(torch.float32),
    "int4-bf16": _int4(torch.bfloat16),
}


# ---- plans ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FormatPlan:
    """Which kernel serves a product of M rows: `kernels[i]` for M <= BUCKETS[i] (last: larger)."""

    kernels: tuple[str, ...]  # one per bucket

    def __post_init__(self) -> None:
        if len(self.kernels) != len(BUCKETS) or any(k not in KERNELS for k in self.kernels):
            raise SpecDecodeError(f"a format plan needs {len(BUCKETS)} kernels from {sorted(KERNELS)}")

    @property
    def act_dtype(self) -> torch.dtype:
        return torch.bfloat16 if all(k in _BF16 for k in self.kernels) else torch.float32

    @property
    def keeps_fp32_weights(self) -> bool:
        """Whether a kernel of the plan multiplies by the fp32 weight tensor itself (`fp32`,
        `fp32-mkl`); every other kernel holds its own copy, so the weights' masters may be kept
        in bf16 when that loses nothing (NativeDecoder: a 1.5B model's fp32 masters are 6 GB)."""
        return any(k in _MULTIPLY_BY_MASTER for k in self.kernels)

    @property
    def bf16_weights(self) -> bool:
        """Whether every kernel of the plan multiplies by the weights rounded to bf16: then bf16
        masters lose nothing that any product of the plan reads."""
        return all(k in _BF16_WEIGHTS for k in self.kernels)

    @property
    def name(self) -> str:
        """Short description, e.g. `bf16@1,fp32-mkl@2+`."""
        parts, start = [], 0
        for i in range(1, len(BUCKETS) + 1):
            if i == len(BUCKETS) or self.kernels[i] != self.kernels[start]:
                lo = 1 if start == 0 else BUCKETS[start - 1] + 1
                hi = BUCKETS[i - 1]
                rng = f"{lo}+" if i == len(BUCKETS) else (f"{lo}" if lo == hi else f"{lo}-{hi}")
                parts.append(f"{self.kernels[start]}@{rng}")
                start = i
        return ",".join(parts) if len(parts) > 1 else self.kernels[0]

    def to_json(self) -> dict:
        return {"buckets": list(BUCKETS), "kernels": list(self.kernels)}


def forced_plan(name: str, device: torch.device | str = "cpu") -> FormatPlan:
    """One format everywhere; bf16 on CPU multiplies prefill-sized products (M > 16) in fp32."""
    if name not in FORCED:
        raise SpecDecodeError(f"unknown weight format {name!r}; choose one of: auto, {', '.join(FORCED)}")
    if name == "bf16" and torch.device(device).type == "cpu":
        return FormatPlan(tuple("bf16" if m <= 16 else "bf16-up" for m in BUCKETS))
    return FormatPlan((name,) * len(BUCKETS))


def bucket_of(rows: int) -> int:
    """Index of the bucket of `BUCKETS` that serves products of `rows` rows."""
    return min(bisect.bisect_left(BUCKETS, rows), len(BUCKETS) - 1)


def layer_products(
    qkv: Linear, o: Linear, ln2: torch.Tensor, gu: Linear, down: Linear, rows: int
) -> tuple | None:
    """`kernels`' decode_layer arguments from its QKV product to its down product (qkv's kind,
    packed weight, outputs and bias; o's kind, packed weight and outputs; the post-attention norm
    weight ln2; gate/up's and down's likewise) when each product of `rows` rows runs one of our
    compiled kernels (`OURS`) and only QKV has a bias; else None."""
    prods = [lin.ours(rows) for lin in (qkv, o, gu, down)]
    if None in prods or any(p[3] is not None for p in prods[1:]):
        return None
    (kq, pq, nq, bq), (ko, po, no, _), (kg, pg, ng, _), (kd, pd, nd, _) = prods
    return (kq, pq, nq, bq, ko, po, no, ln2, kg, pg, ng, kd, pd, nd)


def layers_args(layers) -> tuple[list, list, list]:
    """`kernels`' decode_layers arguments w, n, qkv_b (weights, kinds and sizes, QKV biases; the
    op's per-layer order) from each layer's (ln1, `layer_products(...)`)."""
    ws, ns, bs = [], [], []
    for ln1, (kq, pq, nq, bq, ko, po, no, ln2, kg, pg, ng, kd, pd, nd) in layers:
        ws += [ln1, pq, po, ln2, pg, pd]
        ns += [kq, nq, ko, no, kg, ng, kd, nd]
        bs.append(bq)
    return ws, ns, bs


class Linear:
    """One projection in a plan's formats: each distinct kernel holds its own copy of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: FormatPlan) -> None:
        made: dict[str, Product] = {}
        for k in plan.kernels:
            if k not in made:
                made[k] = KERNELS[k](weight, bias)
        self._by_bucket = [made[k] for k in plan.kernels]
        self.kernels = plan.kernels  # the kernel of each row bucket
        self.macs = weight.shape[0] * weight.shape[1]  # multiply-adds per row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return self._by_bucket[bucket_of(x.shape[0])](x)

    def ours(self, rows: int) -> tuple | None:
        """(kind, packed, n, bias) of the product that serves `rows` rows when it is one of our
        compiled kernels (`OURS`), for `kernels`' decode_layer; else None."""
        return getattr(self._by_bucket[bucket_of(rows)], "ours", None)

    def nbytes(self, rows: int = 1) -> int:
        """Bytes of weights a product of `rows` rows streams (its kernel's copy)."""
        return self._by_bucket[bucket_of(rows)].nbytes


# ---- measurement ------------------------------------------------------------------------------
def measure_kernels(
    shapes: Sequence[tuple[int, int]],  # (out, in) of one layer's products
    head: tuple[int, int] | None,  # (out, in) of the LM head, or None
    num_layers: int,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    buckets: Sequence[int] = BUCKETS,
    repeats: int = 5,
) -> dict[str, list[float | None]]:
    """Fastest ms of one forward's products per kernel and bucket (None: refused here).

    `_MEASURE_LAYERS` layers of random weights are timed and scaled to `num_layers`; the head
    is timed once. Candidates are interleaved within each repeat so machine noise hits all
    alike, and the minimum over repeats is kept: interference only ever adds time. Buckets
    past `LARGE` rows (prefill packs, the trainer's target forward) would take minutes on a
    big model: they are timed with two repeats, without the head (which sees one row per
    request there) and only for the kernels within 2x of the fastest at the bucket before
    (None for the rest).
    """
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes] for _ in range(_MEASURE_LAYERS)]
    head_w = None if head is None else torch.randn(*head, generator=gen) * 0.02
    prepared: dict[str, tuple[list[Product], Product | None]] = {}
    for k in candidates:
        try:
            fns = [KERNELS[k](w, None) for layer in layers for w in layer]
            hf = None if head_w is None else KERNELS[k](head_w, None)
            x = torch.randn(2, shapes[0][1])
            ref = torch.mm(x, layers[0][0].t())
            err = float((fns[0](x).float() - ref).norm() / ref.norm())
            if not err < (0.25 if k.startswith("int4") else 0.05):  # int4 rounds coarsely
                continue  # a kernel that computes something else here is no candidate
            prepared[k] = (fns, hf)
        except (RuntimeError, NotImplementedError, AttributeError):
            continue
    scale = num_layers / _MEASURE_LAYERS
    out: dict[str, list[float | None]] = {k: [None] * len(buckets) for k in candidates}
    for bi, m in enumerate(buckets):
        large = m > LARGE and bi > 0
        acts = {i: torch.randn(m, i, generator=gen) for _, i in shapes}
        h = None if head is None or large else torch.randn(m, head[1], generator=gen)
        racing = prepared
        if large:
            prev = {k: out[k][bi - 1] for k in prepared if out[k][bi - 1] is not None}
            racing = {k: prepared[k] for k in prev if prev[k] <= 2 * min(prev.values())}
        times: dict[str, list[float]] = {k: [] for k in racing}
        for r in range((2 if large else repeats) + 1):
            for k, (fns, hf) in racing.items():
                t0 = time.perf_counter()
                for j, fn in enumerate(fns):
                    fn(acts[shapes[j % len(shapes)][1]])
                t1 = time.perf_counter()
                if hf is not None and h is not None:
                    hf(h)
                t2 = time.perf_counter()
                if r:  # the first round warms up
                    times[k].append(((t1 - t0) * scale + (t2 - t1)) * 1e3)
        for k, ts in times.items():
            out[k][bi] = min(ts)
    return out


def plan_from_profile(profile: dict[str, list[float | None]], slack: float = PLAN_SLACK) -> FormatPlan:
    """The fastest kernel per bucket, from as few kernels as possible.

    Every distinct kernel in a plan holds its own copy of every weight, so a plan takes the
    smallest set of kernels in which each bucket has one within `slack` of that bucket's
    fastest (ties: the least total time), then the fastest of the set per bucket; never more
    than `MAX_COPIES` kernels (if none that few cover every bucket within the slack: the set
    of that size with the least total time).
    """
    best = []
    for bi in range(len(BUCKETS)):
        timed = [v[bi] for v in profile.values() if v[bi] is not None]
        if not timed:
            raise SpecDecodeError("no weight format could be measured on this machine; pass --dtype fp32")
        best.append(min(timed))
    names = [k for k, v in profile.items() if any(t is not None for t in v)]
    ranked = []  # (outside the slack somewhere, kernels if not, total ms, plan)
    for size in range(1, min(MAX_COPIES, len(names)) + 1):
        for ks in itertools.combinations(names, size):
            chosen = []
            for bi in range(len(BUCKETS)):
                timed = [k for k in ks if profile[k][bi] is not None]
                chosen.append(min(timed, key=lambda k, b=bi: profile[k][b]) if timed else None)
            if None in chosen:
                continue
            loose = any(profile[k][bi] > best[bi] * slack for bi, k in enumerate(chosen))
            total = sum(profile[k][bi] for bi, k in enumerate(chosen))
            ranked.append((loose, 0 if loose else size, total, tuple(chosen)))
    return FormatPlan(min(ranked)[3])


def _measurement_key(
    shapes: Sequence[tuple[int, int]],
    head: tuple[int, int] | None,
    num_layers: int,
    candidates: Sequence[str],
    buckets: Sequence[int],
    *extra: str,
) -> str:
    """What a format measurement depends on (torch, CPU capability and model, threads, the
    model's shapes, the candidates and buckets timed, and `extra`), hashed: its cache key."""
    ident = [
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        cpu_model(),
        str(torch.get_num_threads()),
        json.dumps([list(s) for s in shapes]),
        str(head),
        str(num_layers),
        ",".join(candidates),
        ",".join(map(str, buckets)),
        *extra,
    ]
    return hashlib.sha256("|".join(ident).encode()).hexdigest()[:24]


def auto_plan(
    shapes: Sequence[tuple[int, int]], head: tuple[int, int] | None, num_layers: int, device: torch.device
) -> tuple[FormatPlan, dict]:
    """The measured plan for these shapes on this machine (cached); returns (plan, record)."""
    if device.type != "cpu":
        return forced_plan("bf16"), {"reason": f"{device.type}: bf16 tensor cores"}

    key = _measurement_key(
        shapes,
        head,
        num_layers,
        AUTO_CANDIDATES,
        BUCKETS,
        f"{PLAN_SLACK},{MAX_COPIES}",
        kernels.source_tag(),  # our kernels changed: time them again
    )
    path = cache_dir() / "formats" / f"{key}.json"

    def measure() -> dict:
        profile = measure_kernels(shapes, head, num_layers)
        plan = plan_from_profile(profile)
        return {
            "plan": plan.to_json(),
            "name": plan.name,
            "ms_per_forward": profile,
            "cpu": cpu_model(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }

    rec = cached_measurement(path, measure)
    return FormatPlan(tuple(rec["plan"]["kernels"])), rec


def quantized_plan(
    name: str,
    shapes: Sequence[tuple[int, int]],
    head: tuple[int, int] | None,
    num_layers: int,
    device: torch.device,
) -> tuple[FormatPlan, dict]:
    """`--dtype int8|int4` (module docstring): the candidate whose products of up to
    `DECODE_ROWS` rows take the least time on these shapes here (cached), one kernel for every
    bucket. Returns (plan, record)."""
    if name not in QUANTIZED_CANDIDATES:
        raise SpecDecodeError(
            f"{name!r} is not a quantized format; choose one of {', '.join(QUANTIZED_CANDIDATES)}"
        )
    if torch.device(device).type != "cpu":
        return forced_plan(name, device), {"reason": "one format"}
    candidates = QUANTIZED_CANDIDATES[name]
    buckets = [m for m in BUCKETS if m <= DECODE_ROWS]
    key = _measurement_key(shapes, head, num_layers, candidates, buckets)

    def measure() -> dict:
        profile = measure_kernels(shapes, head, num_layers, candidates, buckets)
        timed = {k: sum(v) for k, v in profile.items() if None not in v}
        if not timed:
            raise SpecDecodeError(f"no {name} kernel could be measured on this machine; pass --dtype fp32")
        best = min(timed, key=timed.get)
        return {"plan": FormatPlan((best,) * len(BUCKETS)).to_json(), "name": best, "ms_per_forward": profile}

    rec = cached_measurement(cache_dir() / "formats" / f"{name}-{key}.json", measure)
    return FormatPlan(tuple(rec["plan"]["kernels"])), rec


def int8_drafter_plan(
    base: FormatPlan, shapes: Sequence[tuple[int, int]], device: torch.device
) -> tuple[FormatPlan, dict]:
    """The plan an int8-stored drafter's own products run in (cached): for each bucket of up to
    `DRAFT_ROWS` rows, the faster of `base`'s kernel (the target's measured plan) and `int8w`,
    timed on the drafter's product shapes; `base`'s kernel past that. `int8w` re-quantizes the
    loaded weights (fp32 q * scale), which gives back the checkpoint's own int8 values
    (`int8_quantize`): it reads the drafter as stored, in a quarter of fp32's bytes. Returns
    (plan, record)."""
    if torch.device(device).type != "cpu":
        return base, {"reason": f"{torch.device(device).type}: the target's formats"}
    buckets = [m for m in BUCKETS if m <= DRAFT_ROWS]
    candidates = tuple(dict.fromkeys([*base.kernels[: len(buckets)], "int8w"]))
    key = _measurement_key(shapes, None, 1, candidates, buckets, ",".join(base.kernels), kernels.source_tag())

    def measure() -> dict:
        profile = measure_kernels(shapes, None, 1, candidates, buckets)
        chosen = list(base.kernels)
        for bi, k in enumerate(base.kernels[: len(buckets)]):
            mine, theirs = profile["int8w"][bi], profile[k][bi]
            if mine is not None and (theirs is None or mine < theirs):
                chosen[bi] = "int8w"
        plan = FormatPlan(tuple(chosen))
        return {"plan": plan.to_json(), "name": plan.name, "ms_per_forward": profile}

    rec = cached_measurement(cache_dir() / "formats" / f"drafter-{key}.json", measure)
    return FormatPlan(tuple(rec["plan"]["kernels"])), rec
