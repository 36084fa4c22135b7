"""Served tau of drafters on held-out chat and code prompts: the training issue's headline figures.

For each drafter (`METHOD[:K][=DIR]`, default: the drafter shipped for the target, K its usual
draft length; a tree method's K is its node budget) and each prompt source, the real speculative
loop (fixed K; `scaling_curve.served`, the scaling curve's own measure) at temperature 0 and 1
(`--temperatures`: others too) gives tau (tokens per target forward) and the acceptance per draft
position. Sources: `chat` and `code` are the benchmark's MT-Bench and HumanEval prompts (chat
template; the training prompts are kept disjoint from them), `prompts` the held-out split of a
prompt set (`--eval-data`).
Timing plays no part: tau is the same on a busy machine.

Usage: OMP_NUM_THREADS=2 python benchmarks/served_tau.py --target smollm2-135m \
           --drafters eagle:4,eagle-tree:16,dspark:7,dflash:6 --sources chat,code --num-prompts 24 \
           --out benchmarks/results/served-tau-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory
from scaling_curve import served

from specdecode.datasets import load_category
from specdecode.drafters import DEFAULT_NUM_DRAFT, build_drafter
from specdecode.models.loader import load_model
from specdecode.training.calibrate import heldout_prompts
from specdecode.training.regen import prompt_ids


def parse_drafter(spec: str) -> tuple[str, int, str | None]:
    """`METHOD[:K][=DIR]` -> (method, K (default: the method's own, as `generate` uses), checkpoint
    dir or None for the shipped one)."""
    head, _, ckpt = spec.partition("=")
    method, _, k = head.partition(":")
    return method, int(k) if k else DEFAULT_NUM_DRAFT[method], ckpt or None


def prompts_of(source: str, target, n: int, eval_data: str | None) -> list[list[int]]:
    if source == "prompts":
        if not eval_data:
            raise SystemExit("--sources prompts needs --eval-data (a prompt set with heldout.jsonl)")
        return heldout_prompts(eval_data, target, n)
    return [prompt_ids(target, r) for r in load_category(source, n)]


def shown(method: str, result: dict) -> dict:
    """A tree's K is its node budget, deeper than any path: its trailing depths with no accepted
    draft (past the deepest path, or reached and never accepted) are left out of the report
    (they stay in OUT.json)."""
    acc = list(result["acceptance"])
    while "-tree" in method and acc and acc[-1] == 0.0:
        acc.pop()
    return {**result, "acceptance": acc}


def temperature_key(t: float) -> str:
    """A row's key for one temperature: `greedy`, `t1`, else e.g. `t0.7`."""
    return "greedy" if t == 0 else "t1" if t == 1 else f"t{t:g}"


def temperature_name(key: str) -> str:
    return "greedy" if key == "greedy" else f"T={key[1:]}"


def write_report(out: Path, rows: list[dict], meta: dict) -> None:
    keys = [temperature_key(t) for t in meta.get("temperatures", (0.0, 1.0))]
    lines = [
        f"# Served tau on held-out prompts: {meta['target']} (benchmarks/served_tau.py)",
        "",
        f"Machine: {meta['machine']}. Real speculative loop, fixed K, {meta['max_new_tokens']} new "
        f"tokens, the first {meta['num_prompts']} prompts of each source, chat template; tau = "
        "tokens per target forward. `chat`: MT-Bench, `code`: HumanEval (the benchmark's prompts, "
        "disjoint from every training prompt), `prompts`: the held-out split of the training prompt set.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| drafter | K | source | "
        + " | ".join(f"tau {(n := temperature_name(k))} | acceptance per position ({n})" for k in keys)
        + " |",
        "|---|---|---|" + "---|---|" * len(keys),
    ]
    for r in rows:
        r = {**r, **{key: shown(r["method"], r[key]) for key in keys}}
        cells = " | ".join(f"{r[k]['tau']} | {r[k]['acceptance']}" for k in keys)
        name = f"{r['method']}{'' if r['drafter'] is None else ' (' + r['drafter'] + ')'}"
        lines.append(f"| {name} | {r['k']} | {r['source']} | {cells} |")
    lines += [
        "",
        "A tree's acceptance per position is per depth along the accepted path (a node at depth j",
        "is accepted when the path to it is); a chain's is P(draft j accepted | drafts before it).",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", default="eagle:4,eagle-tree:16,dspark:7,dflash:6")
    ap.add_argument("--sources", default="chat,code", help="chat, code, prompts (comma-separated)")
    ap.add_argument("--eval-data", default=None, help="prompt set with heldout.jsonl (for `prompts`)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    ap.add_argument("--out", required=True, help="OUT.md and OUT.json")
    a = ap.parse_args()
    target = load_model(a.target)
    drafters = [parse_drafter(s) for s in a.drafters.split(",")]
    sources = {s: prompts_of(s, target, a.num_prompts, a.eval_data) for s in a.sources.split(",")}
    meta = {
        "target": a.target,
        "machine": cpu_kind(),
        "max_new_tokens": a.max_new_tokens,
        "num_prompts": a.num_prompts,
        "temperatures": [float(t) for t in a.temperatures.split(",")],
        "command": "python benchmarks/served_tau.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k != "out"
        ),
    }
    rows = []
    for method, k, ckpt in drafters:
        drafter = build_drafter(method, target, ckpt)
        for source, prompts in sources.items():
            row = {"method": method, "k": k, "drafter": ckpt, "source": source}
            for t in meta["temperatures"]:
                row[temperature_key(t)] = served(target, drafter, prompts, k, a.max_new_tokens, t)
            print(json.dumps(row), flush=True)
            rows.append(row)
            write_report(Path(a.out), rows, meta)


if __name__ == "__main__":
    main()
