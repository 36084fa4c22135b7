"""One kernel's matrix products for a target's shapes, at a few row counts: the products of one
forward (every layer's four projections and the LM head, random weights of the target's shapes,
so nothing stays in cache between layers), median ms over `--repeats` after a warm-up.

For A/B runs of a kernel change: run it from each checkout in turn (alternating, quiet machine)
and compare the lines. Under `ATEN_CPU_CAPABILITY=avx2` our AVX-512 products are refused
(`kernels.barred`), as on the AVX2 kind.

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


def bench(args) -> dict:
    layer, head, num_layers = shapes_of(args.target)
    gen = torch.Generator().manual_seed(0)
    make = KERNELS[args.kernel]
    fns = [[make(torch.randn(o, i, generator=gen) * 0.02, None) for o, i in layer] for _ in range(num_layers)]
    head_fn = make(torch.randn(*head, generator=gen) * 0.02, None)
    ms = {}
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, i, generator=gen) for _, i in layer]
        xh = torch.randn(m, head[1], generator=gen)

        def forward(xs=xs, xh=xh):
            for products in fns:
                for fn, x in zip(products, xs, strict=True):
                    fn(x)
            head_fn(xh)

        forward()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            forward()
            times.append(time.perf_counter() - t)
        ms[m] = round(statistics.median(times) * 1e3, 2)
    info = machine_info()
    return {"label": args.label, "kernel": args.kernel, "target": args.target, "ms": ms, "machine": info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--kernel", default="bf16w", choices=sorted(KERNELS))
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the result as a JSON line to this file")
    args = ap.parse_args()
    res = bench(args)
    print(f"{res['label']} {res['kernel']}: " + "  ".join(f"M={m} {t} ms" for m, t in res["ms"].items()))
    if args.out:
        with Path(args.out).open("a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
