"""One kernel's matrix products for a target's shapes, at a few row counts: the products of one
forward (every layer's four projections and the LM head, random weights of the target's shapes,
so nothing stays in cache between layers), median ms over `--repeats` after a warm-up.

Several kernels (`--kernel bf16w,bf16-dp`) are timed in one process, interleaved within each
repeat so that the host's drift hits them alike; each line also gives the weights' bytes read per
second. For A/B runs of a kernel change: run it from each checkout in turn (alternating, quiet
machine) and compare the lines. Under `ATEN_CPU_CAPABILITY=avx2` our AVX-512 products are
refused (`kernels.barred`), as on the AVX2 kind.

Usage: OMP_NUM_THREADS=2 python benchmarks/bench_products.py --target smollm2-135m --kernel bf16w \
           --rows 1,4,8,16 [--label new] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdecode.bench.hardware import machine_info
from specdecode.models.formats import KERNELS
from specdecode.models.loader import resolve_path


def shapes_of(target: str) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """(out, in) of one layer's fused products, of the head, and the number of layers."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(resolve_path(target))
    d, hd = c.hidden_size, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    inter = c.intermediate_size
    layer = [(qkv, d), (d, c.num_attention_heads * hd), (2 * inter, d), (d, inter)]
    return layer, (c.vocab_size, d), c.num_hidden_layers


def bench(args) -> list[dict]:
    """One result per kernel of `args.kernel` (comma-separated), timed interleaved."""
    names = args.kernel.split(",")
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise SystemExit(f"unknown kernel {', '.join(unknown)}; choose from {', '.join(sorted(KERNELS))}")
    layer, head, num_layers = shapes_of(args.target)
    gen = torch.Generator().manual_seed(0)
    fns: dict[str, list] = {k: [] for k in names}  # per kernel: every layer's products, then the head
    for w in [torch.randn(o, i, generator=gen) * 0.02 for _ in range(num_layers) for o, i in layer] + [
        torch.randn(*head, generator=gen) * 0.02
    ]:
        for k in names:
            fns[k].append(KERNELS[k](w, None))
    nbytes = {k: sum(getattr(fn, "nbytes", 0) for fn in fs) for k, fs in fns.items()}
    times: dict[str, dict[int, list[float]]] = {k: {} for k in names}
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, i, generator=gen) for _, i in layer] * num_layers + [
            torch.randn(m, head[1], generator=gen)
        ]
        for rep in range(args.repeats + 1):  # the first round warms up
            for k in names:
                t = time.perf_counter()
                for fn, x in zip(fns[k], xs, strict=True):
                    fn(x)
                if rep:
                    times[k].setdefault(m, []).append(time.perf_counter() - t)
    info = machine_info()
    out = []
    for k in names:
        ms = {m: round(statistics.median(ts) * 1e3, 2) for m, ts in times[k].items()}
        gbs = {m: round(nbytes[k] / (t * 1e-3) / 1e9, 1) for m, t in ms.items()} if nbytes[k] else {}
        out.append({"label": args.label, "kernel": k, "target": args.target, "ms": ms, "gb_per_s": gbs,
                    "machine": info})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--kernel", default="bf16w", help="one kernel of formats.KERNELS, or several: a,b")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the result as a JSON line to this file")
    args = ap.parse_args()
    for res in bench(args):
        gbs = res["gb_per_s"]
        print(
            f"{res['label']} {res['kernel']}: "
            + "  ".join(
                f"M={m} {t} ms" + (f" ({gbs[m]} GB/s)" if m in gbs else "") for m, t in res["ms"].items()
            )
        )
        if args.out:
            with Path(args.out).open("a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
