"""What one step's verification costs after the target's forward: our CPU kernel
(`verify_native`) against the tensor path of `specdecode.verify`, side by side in one process.

`verify.verify_step` on the target's real vocabulary (SmolLM2: 49,152 ids) for one request, a
chain of K drafts with full-vocabulary draft distributions q (as EAGLE-3 and DSpark hand over at
T > 0), greedy and at T = 1, for K in --ks. The two paths alternate call by call (the tensor
path: `native_chain` and `argmax_ids` switched to their fallbacks), `--repeats` calls each after
a warm-up; medians in microseconds, and the ratio. Usage:

    python benchmarks/bench_verify.py --out benchmarks/results/verify-<name>
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import specdecode.verify as verify_mod
from specdecode.bench.hardware import machine_info
from specdecode.config import SamplingParams
from specdecode.drafter import Proposal


class _Stream:
    """A request's randomness, as request.RunningRequest provides it."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def sample_uniforms(self, start: int, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--ks", default="0,1,4,7")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    V = a.vocab
    native = (verify_mod.native_chain, verify_mod.argmax_ids)
    tensor = (lambda *args: None, lambda x, v=None: x[..., : (x.shape[-1] if v is None else v)].argmax(-1))

    def use(fns):
        verify_mod.native_chain, verify_mod.argmax_ids = fns

    g = torch.Generator().manual_seed(0)
    rows = []
    for K in [int(k) for k in a.ks.split(",")]:
        logits = torch.randn(1, K + 1, V, generator=g) * 3
        q = torch.softmax(torch.randn(1, K, V, generator=g) * 3, -1)
        ids = torch.multinomial(q[0], 1, generator=g).view(1, K) if K else torch.zeros(1, 0, dtype=torch.long)
        for name, T in (("greedy", 0.0), ("T=1", 1.0)):
            prop = Proposal(draft_ids=ids, num_draft=torch.tensor([K]), draft_probs=None if T == 0 else q)
            params, streams = [SamplingParams(temperature=T)], [_Stream(1)]

            def call(prop=prop, logits=logits, params=params, streams=streams):
                verify_mod.verify_step(prop, logits, params, streams, [0], V)

            times = {"kernel": [], "tensor": []}
            for fns in (native, tensor):  # warm-up
                use(fns)
                for _ in range(10):
                    call()
            for _ in range(a.repeats):
                for which, fns in (("kernel", native), ("tensor", tensor)):
                    use(fns)
                    times[which].append(_time(call))
            use(native)
            kern, tens = statistics.median(times["kernel"]), statistics.median(times["tensor"])
            row = {"K": K, "sampling": name, "kernel_us": kern, "tensor_us": tens, "ratio": tens / kern}
            rows.append(row)
            print(f"K={K} {name}: kernel {kern:.0f} us, tensor path {tens:.0f} us ({tens / kern:.1f}x)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**machine_info(), "threads": torch.get_num_threads(), "vocab": V, "repeats": a.repeats}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# One step's verification: our CPU kernel against the tensor path",
        "",
        f"Machine: {meta.get('cpu', '?')}, {meta['threads']} threads; one request, vocabulary {V}, "
        f"medians of {a.repeats} calls each, the two paths alternating.",
        "",
        "Command: `python benchmarks/bench_verify.py --out DIR`",
        "",
        "| K | sampling | kernel (us) | tensor path (us) | tensor / kernel |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        us = f"{r['kernel_us']:.0f} | {r['tensor_us']:.0f}"
        lines.append(f"| {r['K']} | {r['sampling']} | {us} | {r['ratio']:.1f}x |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
