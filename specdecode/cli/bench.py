"""`specdecode bench`: methods side by side on the benchmark categories (report + plots).

Contract: flags map one to one onto `bench.harness.BenchConfig` (validated there); `--drafter`
takes METHOD=MODEL and may repeat. Prints the report when the run is complete.
"""

from __future__ import annotations

import argparse

from specdecode.bench.harness import BenchConfig, run_bench
from specdecode.cli import options
from specdecode.errors import SpecDecodeError


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods side by side (report + plots)")
    options.add_target(b)
    b.add_argument("--methods", default="ar,ngram", help="comma-separated; ar is always included")
    b.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="METHOD=MODEL",
        help="drafter model per method, e.g. draft=qwen2.5-coder-0.5b (repeatable)",
    )
    b.add_argument("--datasets", default="all", help="categories (comma-separated), 'all', or FILE.jsonl")
    b.add_argument("--limit", type=int, default=8, help="prompts per category")
    b.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    b.add_argument("--batch-size", type=int, nargs="+", default=[1])
    options.add_max_new_tokens(b)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--peers", default="", help="comma-separated: hf, hf-assisted, hf-lookup")
    options.add_num_draft_tokens(b)
    options.add_policy(b, choices=("fixed", "adaptive"))
    options.add_dtype(b)
    options.add_device(b)
    options.add_seed(b)
    options.add_out(b, "output directory (results.json, report.md, plots)")
    b.set_defaults(handler=bench)


def _drafters(specs: list[str]) -> dict[str, str]:
    drafters = {}
    for spec in specs:
        method, sep, model = spec.partition("=")
        if not sep or not method or not model:
            raise SpecDecodeError(
                f"--drafter takes METHOD=MODEL (e.g. draft=qwen2.5-coder-0.5b), got {spec!r}"
            )
        drafters[method] = model
    return drafters


def bench(a: argparse.Namespace) -> None:
    cfg = BenchConfig(
        target=a.target,
        methods=[m for m in a.methods.split(",") if m],
        drafters=_drafters(a.drafter),
        datasets=a.datasets,
        limit=a.limit,
        temperatures=a.temperature,
        batch_sizes=a.batch_size,
        max_new_tokens=a.max_new_tokens,
        repeats=a.repeats,
        peers=[p for p in a.peers.split(",") if p],
        num_draft_tokens=a.num_draft_tokens,
        policy=a.policy,
        dtype=a.dtype,
        device=a.device,
        seed=a.seed,
        out=a.out,
    )
    out = run_bench(cfg)
    print((out / "report.md").read_text())
