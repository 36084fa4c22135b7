"""Decoders paired per prompt in one process: the A/B runs behind the policy and drafter reports.

Contract:
- `paired_runs(decoders, prompts, temperature, max_new_tokens, repeats)` decodes every prompt
  ((category, prompt ids) pairs) with every decoder in turn, the order reversed every repeat;
  repeat 0 warms up and is not kept; the same seed per prompt and repeat for every decoder.
  Returns {(decoder name, category): [(seconds per token, tau, drafts per step), ...]}.
- `paired_rows(runs, categories, base)`: per category and decoder (all but `base`), the median
  over prompts of `base`'s time per token over the decoder's (the paired speed-up), the mean tau
  and the mean drafts per step.
- `paired_table(rows, label)`: those rows as a markdown table, `label` naming the decoder column.
- `add_paired_arguments(ap, datasets, limit, temperature)`: the options every paired script
  takes (--target, --datasets, --limit, --temperature, --max-new-tokens, --repeats, --out), with
  the script's defaults for the first three that differ.
- `write_paired_report(out, title, script, args, machine, setting, rows, label)`: `out`/report.md
  (the title, the machine, the run's settings from `args` (temperature, max_new_tokens, limit,
  repeats), `setting` appended to them, the command that reran it, the table) and results.json.
Timing: run on a quiet machine; pairing per prompt keeps slow drifts of the host out of ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

from specdecode.config import SamplingParams
from specdecode.request import GenerationRequest


def add_paired_arguments(ap: argparse.ArgumentParser, datasets: str, limit: int, temperature: float) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--datasets", default=datasets)
    ap.add_argument("--limit", type=int, default=limit)
    ap.add_argument("--temperature", type=float, default=temperature)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)


def paired_runs(
    decoders: dict,
    prompts: list[tuple[str, list[int]]],
    temperature: float,
    max_new_tokens: int,
    repeats: int,
) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    runs = collections.defaultdict(list)
    names = list(decoders)
    for rep in range(repeats + 1):  # repeat 0 warms up
        for i, (cat, ids) in enumerate(prompts):
            for name in names if rep % 2 == 0 else names[::-1]:
                params = SamplingParams(temperature=temperature)
                req = GenerationRequest(ids, params, max_new_tokens, seed=1000 * rep + i)
                out = decoders[name].generate([req])[0]
                if rep:
                    steps = max(out.num_steps, 1)
                    per_token = out.decode_time_s / out.num_new_tokens
                    runs[(name, cat)].append((per_token, out.tau, out.num_drafted / steps))
    return runs


def paired_rows(runs: dict, categories: list[str], base: str = "ar") -> list[dict]:
    names = list(dict.fromkeys(name for name, _ in runs))
    rows = []
    for cat in categories:
        ref = runs[(base, cat)]
        for name in names:
            if name == base:
                continue
            got = runs[(name, cat)]
            rows.append(
                {
                    "category": cat,
                    "decoder": name,
                    "speedup": statistics.median(b[0] / g[0] for b, g in zip(ref, got, strict=True)),
                    "tau": statistics.mean(g[1] for g in got),
                    "drafts": statistics.mean(g[2] for g in got),
                }
            )
    return rows


def paired_table(rows: list[dict], label: str) -> list[str]:
    lines = [f"| category | {label} | speed-up over ar | tau | drafts / step |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['category']} | {r['decoder']} | {r['speedup']:.3f}x | {r['tau']:.2f} | {r['drafts']:.2f} |"
        )
    return lines


def write_paired_report(
    out: Path,
    title: str,
    script: str,
    args: argparse.Namespace,
    machine: str,
    setting: str,
    rows: list[dict],
    label: str,
) -> None:
    cmd = f"python benchmarks/{script} " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None
    )
    lines = [
        f"# {title}",
        "",
        f"Machine: {machine}. T = {args.temperature:g}, {args.max_new_tokens} new tokens, the first "
        f"{args.limit} prompts of each category, {args.repeats} repeats after a warm-up, every decoder in "
        f"one process (paired per prompt and repeat, order alternating){setting}. Speed-up: median over "
        "prompts of `ar`'s time per token over the decoder's; tau and drafts per step: means over requests.",
        "",
        f"Command: `{cmd}`",
        "",
        *paired_table(rows, label),
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
