"""Decoding-loop throughput of two checkouts, interleaved (A B A B ...): did a change to the loop
cost speed?

Each round runs one child process per checkout (`PYTHONPATH=<checkout>`, the same environment):
it loads the target once, warms up, then decodes the same prompts (greedy, chat template) with
`ar` and `ngram` at fixed K and prints tokens/s per method. The report gives the median over
rounds per checkout and the per-round ratio B/A. Usage:

    python benchmarks/bench_loop_ab.py --a /path/to/old/checkout --b . --rounds 5 \
        --out benchmarks/results/loop-ab-<name>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
from specdecode import load
torch.manual_seed(0)
prompts = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash table is in three sentences.",
           "def fibonacci(n):\n    # return the n-th Fibonacci number",
           "List five uses of a binary search tree."]
out = {}
for method, k in (("ar", 0), ("ngram", 4)):
    sd = load(sys.argv[1], method=method, policy="fixed", num_draft_tokens=k, dtype=sys.argv[2])
    sd.generate(prompts[0], max_new_tokens=8, chat=True)  # warm-up
    t0 = time.perf_counter()
    n = sum(sd.generate(p, max_new_tokens=int(sys.argv[3]), chat=True).num_new_tokens for p in prompts)
    out[method] = n / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def run(checkout: str, target: str, dtype: str, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, target, dtype, str(tokens)], env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"{checkout}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="baseline checkout")
    ap.add_argument("--b", required=True, help="changed checkout")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for i in range(a.rounds):
        ra = run(a.a, a.target, a.dtype, a.tokens)
        rb = run(a.b, a.target, a.dtype, a.tokens)
        rows.append({"a": ra, "b": rb})
        print(f"round {i + 1}: A {ra}  B {rb}", file=sys.stderr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": vars(a), "rounds": rows}, indent=1))
    lines = [
        f"# Loop throughput A/B ({a.target}, {a.dtype}, greedy, chat template, "
        f"{a.tokens} tokens x 4 prompts)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}. A = `{a.a}`, B = `{a.b}`; "
        f"{a.rounds} rounds, A and B interleaved, one fresh process each.",
        "",
        f"Command: `python benchmarks/bench_loop_ab.py --a A --b B --rounds {a.rounds} --out {a.out}`",
        "",
        "| method | A tok/s (median) | B tok/s (median) | B/A per round (median, min-max) |",
        "|---|---|---|---|",
    ]
    for m in ("ar", "ngram"):
        ta = [r["a"][m] for r in rows]
        tb = [r["b"][m] for r in rows]
        ratio = [y / x for x, y in zip(ta, tb, strict=True)]
        lines.append(
            f"| {m} | {statistics.median(ta):.1f} | {statistics.median(tb):.1f} | "
            f"{statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}) |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
