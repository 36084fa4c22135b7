"""Two runtime levers of continuous batching, timed side by side on this machine:

1. Prompt chunks riding in a decode step: the target's forward of a decode batch (B rows, one
   token each, ~`--context` tokens of context), a prompt chunk of P tokens on its own forward, and
   both packed into one forward (`models.base.forward_packed`: the products see every token,
   attention runs per segment). What riding saves is own + step - packed.
2. The attention kernel on a regeneration-shaped decode step (64 rows, SmolLM2's 3 KV heads of
   3 query heads, ragged contexts of 150-700 tokens): keys and values in fp32 vs bf16
   (`--kv-cache-dtype bf16`), per layer.

Each figure is the median of `--repeats` timings after warm-up, the variants of a row timed
in turn within each repeat.

Usage: OMP_NUM_THREADS=2 python benchmarks/bench_packed.py --out benchmarks/results/packed-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdecode.models import kernels
from specdecode.models.base import Segment, forward_packed
from specdecode.models.loader import load_model

SHAPES = ((1, 12), (4, 12), (8, 40), (64, 200))  # (decode rows B, prompt chunk tokens P)


def median_ms(fns: list, repeats: int) -> list[float]:
    """Median ms of each function, timed in turn within every repeat (so drift in the machine's
    speed, e.g. a neighbour on a shared host, falls on all of them alike)."""
    for _ in range(3):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(ts) for ts in times]


def time_riding(model, B: int, P: int, context: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(B * 1000 + P)
    cache = model.new_cache(B + 1, context + P + 8)
    for s in range(B):
        model.prefill(torch.randint(0, 1000, (1, context), generator=gen), cache, [s])
    step = Segment(torch.randint(0, 1000, (B, 1), generator=gen), None, list(range(B)))
    chunk = Segment(torch.randint(0, 1000, (1, P), generator=gen), torch.arange(P)[None], [B], logits=False)
    own, alone, packed = median_ms(
        [
            lambda: forward_packed(model, cache, [chunk]),
            lambda: forward_packed(model, cache, [step]),
            lambda: forward_packed(model, cache, [step, chunk]),
        ],
        repeats,
    )
    return {"B": B, "P": P, "step_ms": alone, "chunk_own_ms": own, "packed_ms": packed}


def time_attention(repeats: int) -> dict:
    ops = kernels.fused()
    if ops is None:
        return {"skipped": kernels.unavailable.get("cpu", "no kernels")}
    gen = torch.Generator().manual_seed(0)
    B, Hk, G, D, S = 64, 3, 3, 64, 800
    lens = torch.randint(150, 700, (B,), generator=gen)
    span = int(lens.max()) + 1
    q = torch.randn(B, Hk, G, D, generator=gen)
    kv = torch.randn(2, B, Hk, S, D, generator=gen)[..., :span, :]
    mask = (torch.arange(span).view(1, span) <= lens.view(B, 1)).view(B, 1, 1, span).repeat(1, 1, G, 1)
    k16, v16 = kv.bfloat16().unbind(0)
    variants = [lambda: ops.attention(q, kv[0], kv[1], mask), lambda: ops.attention(q, k16, v16, mask)]
    fp32, bf16 = median_ms(variants, repeats)
    return {"rows": B, "mean_context": float(lens.float().mean()), "fp32_ms": fp32, "bf16_ms": bf16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/packed-smollm2-135m")
    a = ap.parse_args()
    lm = load_model(a.target, dtype=a.dtype, device="cpu")
    rides = [time_riding(lm.model, B, P, a.context, a.repeats) for B, P in SHAPES]
    attn = time_attention(a.repeats)
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
    machine += f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"target": a.target, "format": lm.model.info.format, "machine": machine, "rides": rides}
    res["attention"] = attn
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [
        f"# Packed prompt chunks and bf16 KV attention ({a.target}, {lm.model.info.format})",
        "",
        f"Machine: {machine}. Command: `OMP_NUM_THREADS={torch.get_num_threads()} python "
        f"benchmarks/bench_packed.py`. Medians of {a.repeats} timings after warm-up.",
        "",
        f"## A prompt chunk riding in a decode step (context {a.context} tokens)",
        "",
        "| decode rows B | chunk tokens P | step alone ms | chunk alone ms | packed ms | saved ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rides:
        saved = r["step_ms"] + r["chunk_own_ms"] - r["packed_ms"]
        lines.append(
            f"| {r['B']} | {r['P']} | {r['step_ms']:.1f} | {r['chunk_own_ms']:.1f} | {r['packed_ms']:.1f} "
            f"| {saved:.1f} |"
        )
    lines += ["", "## Decode attention, regeneration-shaped, per layer", ""]
    if "skipped" in attn:
        lines.append(f"skipped: {attn['skipped']}")
    else:
        lines += [
            f"{attn['rows']} rows, 3 KV heads x 3 query heads, head size 64, mean context "
            f"{attn['mean_context']:.0f}: keys and values fp32 {attn['fp32_ms']:.2f} ms, "
            f"bf16 {attn['bf16_ms']:.2f} ms ({attn['bf16_ms'] / attn['fp32_ms']:.2f}x).",
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
