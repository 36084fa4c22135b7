"""Runtime benchmark: where a target step's time goes, per weight format, on this machine.

For each `--formats` entry (a `--dtype` value: auto, bf16, fp32, int8, int4; `kernel:NAME`,
one kernel of `formats.KERNELS` at every size; or `plan:K@1-2/K2@3-64/K3@65+`, a plan as
`FormatPlan.name` writes it with `/` between its parts, e.g. a plan auto chose before) the
target is loaded and measured in one process, formats interleaved per repeat so that machine
noise hits them alike:
- T(N): median ms of one forward of N new tokens (batch 1) over a 256-token cache, N = 1..16,
  and T(8)/T(1), the price of verifying 7 drafts;
- the split of T(1) and T(8) into matrix products, attention, the layers run in one call
  (`decode_layers`: every layer's products, attention and norms) and everything else
  (torch.profiler self CPU time by op name); with `auto` also the row `auto, Python layers`: the same model
  with every layer run op by op from Python, which shows the split inside the layers;
- the bandwidth ceiling of the format: bytes the products read per one-token step / memory
  bandwidth measured here (a large copy), and T(1) as a fraction of it;
- the arithmetic limit of T(8)/T(1): 8 tokens' products at the fastest arithmetic rate measured
  here (a large fp32 GEMM, or the best kernel of auto's measurement) over the T(1) ceiling.
Writes `<out>/report.md` and `<out>/results.json`.

    python benchmarks/bench_runtime.py --target smollm2-135m --out benchmarks/results/runtime-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.models import kernels
from specdecode.models.formats import BUCKETS, FormatPlan
from specdecode.models.loader import load_model

CONTEXT = 256
BLOCKS = (1, 2, 4, 8, 16)
MATMUL_OPS = ("mm", "addmm", "linear", "mkl_linear", "_linear_pointwise", "_weight_int8pack_mm",
              "_weight_int4pack_mm_for_cpu", "matmul", "bmm", "bf16w_linear", "bf16amx_linear",
              "bf16dp_linear", "bf16dp1_linear", "int8w_linear")  # fmt: skip
ATTENTION_OPS = ("scaled_dot_product", "_scaled_dot_product", "flash_attention", "attention")
PY_LAYERS = "auto, Python layers"  # the auto model with decode_layers switched off


def _python_layers(model, on: bool) -> None:
    """Run `model`'s layers op by op from Python (on) or as it chooses (off)."""
    if on:
        model._whole_layers = lambda groups, T: None  # shadows the method on this instance
    else:
        model.__dict__.pop("_whole_layers", None)


def _bandwidth_gbs() -> float:
    """Read bandwidth: best of 5 sums over a 512 MB tensor."""
    x = torch.ones(128 * 2**20)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def _arith_gflops(model) -> dict:
    """Arithmetic rates measured here (GFLOP/s): a square 2048 fp32 GEMM (torch's BLAS), and the
    fastest products in `--dtype auto`'s measurement (any kernel, up to LARGE rows: one forward's
    products, head included, 2 * macs * M flops)."""
    from specdecode.models.formats import BUCKETS, LARGE

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * 2048**3 / (time.perf_counter() - t0) / 1e9)
    out = {"fp32 GEMM 2048": best}
    macs = model.step_macs()
    for k, row in getattr(model, "format_record", {}).get("ms_per_forward", {}).items():
        for m, ms in zip(BUCKETS, row, strict=False):
            if ms and m <= LARGE:
                rate = 2 * macs * m / (ms * 1e-3) / 1e9
                if rate > out.get("products", (0.0,))[0]:
                    out["products"] = (rate, f"{k} at M={m}")
    return out


def _setup(model):
    cache = model.new_cache(1, CONTEXT + max(BLOCKS) + 2)
    ids = torch.randint(0, 1000, (1, CONTEXT + max(BLOCKS)), generator=torch.Generator().manual_seed(0))
    model.forward(ids[:, :CONTEXT], None, cache, [0], logits=False)
    cache.commit(0, CONTEXT)
    return cache, ids


def _forward_ms(model, cache, ids, n: int) -> float:
    x = ids[:, CONTEXT : CONTEXT + n]
    t0 = time.perf_counter()
    model.forward(x, None, cache, [0])
    return (time.perf_counter() - t0) * 1e3


def _split(model, cache, ids, n: int, reps: int = 5) -> dict:
    """Self CPU ms per forward in products / attention / one-call layers / other (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    x = ids[:, CONTEXT : CONTEXT + n]
    model.forward(x, None, cache, [0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            model.forward(x, None, cache, [0])
        wall = (time.perf_counter() - t0) * 1e3 / reps
    out = {"products": 0.0, "attention": 0.0, "one-call layers": 0.0, "other ops": 0.0}
    for ev in prof.key_averages():
        name = ev.key.split("::")[-1]
        ms = ev.self_cpu_time_total / 1e3 / reps
        if name in ("decode_layer", "decode_layers"):
            out["one-call layers"] += ms
        elif name in MATMUL_OPS:
            out["products"] += ms
        elif any(a in name for a in ATTENTION_OPS):
            out["attention"] += ms
        else:
            out["other ops"] += ms
    ops = sum(out.values())
    out["python and dispatch"] = max(wall - ops, 0.0)
    out["wall (profiled)"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--formats", default="auto,bf16,fp32,int8,int4")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    names = [f for f in a.formats.split(",") if f]
    models = {f: _load(a.target, f) for f in names}
    state = {f: _setup(m) for f, m in models.items()}
    if "auto" in models:  # the same weights and cache, layers op by op
        models[PY_LAYERS], state[PY_LAYERS] = models["auto"], state["auto"]
    times = {f: {n: [] for n in BLOCKS} for f in models}
    splits = {}
    with torch.inference_mode():
        for f, m in models.items():  # warm-up
            for n in BLOCKS:
                _python_layers(m, f == PY_LAYERS)
                _forward_ms(m, *state[f], n)
        for _ in range(a.repeats):
            for n in BLOCKS:
                for f, m in models.items():
                    _python_layers(m, f == PY_LAYERS)
                    times[f][n].append(_forward_ms(m, *state[f], n))
        for f, m in models.items():
            _python_layers(m, f == PY_LAYERS)
            splits[f] = {n: _split(m, *state[f], n) for n in (1, 8)}
            _python_layers(m, False)
    bw = _bandwidth_gbs()
    arith = _arith_gflops(models.get("auto", next(iter(models.values()))))
    peak = max(v if isinstance(v, float) else v[0] for v in arith.values())
    res = {}
    for f, m in models.items():
        med = {n: statistics.median(v) for n, v in times[f].items()}
        gb = m.step_weight_bytes() / 1e9
        res[f] = {
            "formats": m.info.format,
            "act_dtype": str(m.info.dtype),
            "forward_ms": med,
            "t8_over_t1": med[8] / med[1],
            "weight_gb_per_step": gb,
            "ceiling_ms": gb / bw * 1e3,
            "fraction_of_ceiling": (gb / bw * 1e3) / med[1],
            # products of 8 tokens at the best measured GEMM rate vs one token at the bandwidth
            # ceiling: the least T(8)/T(1) this machine's arithmetic allows
            "t8_compute_floor_ms": 2 * 8 * m.step_macs() / (peak * 1e9) * 1e3,
            "split_ms": splits[f],
            "auto_record": getattr(m, "format_record", {}),
        }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": a.target, "bandwidth_gbs": bw, "arith_gflops": arith, "peak_gflops": peak,
            "threads": torch.get_num_threads(), "cpu": _cpu(), "torch": torch.__version__,
            "command": " ".join(sys.argv), "kernel_choices": dict(kernels.choices)}  # fmt: skip
    (out / "results.json").write_text(json.dumps({"meta": meta, "formats": res}, indent=1))
    (out / "report.md").write_text(report(meta, res))
    print((out / "report.md").read_text())


def _load(target: str, fmt: str):
    """A `--dtype` value, `kernel:NAME`: one kernel of `formats.KERNELS` at every size (e.g.
    `kernel:int8`, int8 with fp32 activations, beside `int8`, the int8 kernel measured fastest),
    or `plan:...` (`_plan_of`)."""
    if not fmt.startswith(("kernel:", "plan:")):
        return load_model(target, dtype=fmt, device="cpu").model
    model = load_model(target, dtype="fp32", device="cpu").model
    kind, name = fmt.split(":", 1)
    plan = FormatPlan((name,) * len(BUCKETS)) if kind == "kernel" else _plan_of(name)
    model.use_formats(plan, keep_masters=False)
    return model


def _plan_of(spec: str) -> FormatPlan:
    """`bf16-amx@1-64/bf16-onednn@65+` -> the FormatPlan whose `name` is that with commas."""
    ranges = []  # (first rows, last rows or None, kernel)
    for part in spec.split("/"):
        kernel, rows = part.rsplit("@", 1)
        lo, _, hi = rows.rstrip("+").partition("-")
        ranges.append((int(lo), None if rows.endswith("+") else int(hi or lo), kernel))
    kernels = []
    for m in BUCKETS:
        got = [k for lo, hi, k in ranges if lo <= m and (hi is None or m <= hi)]
        if len(got) != 1:
            raise SystemExit(f"plan {spec!r} names {len(got)} kernels for products of {m} rows")
        kernels.append(got[0])
    return FormatPlan(tuple(kernels))


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.backends.cpu.get_cpu_capability()})"
    except OSError:
        pass
    return platform.machine()


def report(meta: dict, res: dict) -> str:
    choices = meta.get("kernel_choices", {})  # variants of our kernels chosen by timing (models.kernels)
    lines = [
        f"# Runtime: where a target step goes ({meta['target']})",
        "",
        f"Machine: {meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}; read bandwidth "
        f"measured here {meta['bandwidth_gbs']:.1f} GB/s. One forward of N new tokens, batch 1, over a "
        f"{CONTEXT}-token cache; medians, formats interleaved per repeat."
        + (
            f" Timed when the kernels loaded: {'; '.join(f'{k}, {v}' for k, v in choices.items())}."
            if choices
            else ""
        ),
        "",
        f"Command: `python {meta['command']}`",
        "",
        "| --dtype | products run as | "
        + " | ".join(f"T({n}) ms" for n in BLOCKS)
        + " | T(8)/T(1) | weights read per step | bandwidth ceiling | T(1) at ceiling |",
        "|---|---|" + "---|" * (len(BLOCKS) + 4),
    ]
    for f, r in res.items():
        ms = " | ".join(f"{r['forward_ms'][n]:.1f}" for n in BLOCKS)
        lines.append(
            f"| {f} | {r['formats']} | {ms} | {r['t8_over_t1']:.2f} | "
            f"{r['weight_gb_per_step'] * 1e3:.0f} MB | {r['ceiling_ms']:.1f} ms | "
            f"{r['fraction_of_ceiling']:.2f} |"
        )
    lines += [
        "",
        "Where the time goes (torch.profiler self CPU time per forward, ms; N = 1 and N = 8):",
        "",
        "| --dtype | N | products | attention | one-call layers | other ops | python and dispatch "
        "| wall (profiled) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f, r in res.items():
        for n, sp in r["split_ms"].items():
            lines.append(
                f"| {f} | {n} | {sp['products']:.1f} | {sp['attention']:.1f} | {sp['one-call layers']:.1f} | "
                f"{sp['other ops']:.1f} | {sp['python and dispatch']:.1f} | {sp['wall (profiled)']:.1f} |"
            )
    peak, arith = meta["peak_gflops"], meta["arith_gflops"]
    fastest = arith.get("products")
    rates = f"a square 2048 fp32 GEMM (torch) runs at {arith['fp32 GEMM 2048']:.0f} GFLOP/s here" + (
        f", the fastest products of auto's measurement at {fastest[0]:.0f} ({fastest[1]})" if fastest else ""
    )
    lines += [
        "",
        f"Arithmetic limit: {rates}. The products of 8 tokens at {peak:.0f} GFLOP/s take at least the "
        "time below, so T(8)/T(1) is at least that time over T(1): over the bandwidth ceiling for a "
        "runtime at the ceiling, over ceiling / 0.6 for one at 0.6 of it (the runtime issue's floor "
        "for T(1)). A slower T(1) lowers the ratio without making anything faster.",
        "",
        "| --dtype | T(8) products at that rate | T(1) ceiling | least T(8)/T(1) at the ceiling "
        "| at 0.6 of it | measured |",
        "|---|---|---|---|---|---|",
    ]
    for f, r in res.items():
        if f == PY_LAYERS:
            continue
        floor, ceil = r["t8_compute_floor_ms"], r["ceiling_ms"]
        lines.append(
            f"| {f} | {floor:.1f} ms | {ceil:.1f} ms | {max(1.0, floor / ceil):.2f} | "
            f"{max(1.0, floor / (ceil / 0.6)):.2f} | {r['t8_over_t1']:.2f} |"
        )
    lines += [
        "",
        "One-call layers: `decode_layers` (models/kernels/layer.cpp), every decoder layer of the "
        "forward in one call whose products, attention and norms are called from C++; `auto, Python "
        "layers` is the same model with each layer run op by op, which shows the split inside.",
    ]
    auto = res.get("auto", {}).get("auto_record", {})
    if auto.get("ms_per_forward"):
        from specdecode.models.formats import BUCKETS

        lines += [
            "",
            f"What `--dtype auto` measured (ms for one forward's products; plan: {auto.get('name')}):",
            "",
            "| kernel | " + " | ".join(f"M={m}" for m in BUCKETS) + " |",
            "|---|" + "---|" * len(BUCKETS),
        ]
        for k, row in auto["ms_per_forward"].items():
            cells = " | ".join("-" if v is None else f"{v:.1f}" for v in row)
            lines.append(f"| {k} | {cells} |")
        lines += ["", "-: refused on this machine, or (past 256 rows) not raced: over 2x the fastest at 256."]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
