"""What data buys the n-gram table: served tau of `ngram-table` against the number of the
target's regenerated answers its table is counted from.

For each size n of `--sizes` (`all` = every answer), the table is counted from the first n answers
of the regen directory's train split (the same thresholds as `specdecode train ngram-table`) and
served in the real speculative loop on the held-out prompts of `--eval-data` (fixed K, greedy and
T = 1): tau and acceptance per draft position, plus the table's size. No training: seconds per
point. Writes OUT.json and OUT.md (+ OUT.png).

Usage: OMP_NUM_THREADS=2 python benchmarks/ngram_table_scaling.py --data runs/data/regen-smollm2 \
           --eval-data runs/data/prompts --out benchmarks/results/ngram-table-scaling-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.drafters.ngram import NgramDrafter, NgramTable
from specdecode.models.loader import load_model
from specdecode.training.calibrate import heldout_prompts
from specdecode.training.ngram_table import table_answers
from specdecode.training.trainer import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="regen directory (its train split)")
    ap.add_argument("--eval-data", required=True, help="prompt set or regen directory with held-out prompts")
    ap.add_argument("--sizes", default="300,1000,3000,10000,all")
    ap.add_argument("--min-counts", default="4", help="comma-separated: each size counted at each")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--num-draft", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True, help="path prefix of OUT.json / OUT.md / OUT.png")
    a = ap.parse_args()
    target = load_model(a.target)
    seqs = table_answers(Path(a.data), target)  # as `train ngram-table` counts them
    prompts = heldout_prompts(a.eval_data, target, a.prompts)
    rows = []
    points = [(size, int(m)) for size in a.sizes.split(",") for m in a.min_counts.split(",")]
    for size, min_count in points:
        n = len(seqs) if size == "all" else min(int(size), len(seqs))
        t0 = time.perf_counter()
        table = NgramTable.build(seqs[:n], min_count=min_count)
        row = {"answers": n, "min_count": min_count, "tokens": sum(len(s) for s in seqs[:n])}
        row["contexts"] = table.size
        row["count_s"] = round(time.perf_counter() - t0, 1)
        for temp in (0.0, 1.0):
            ev = evaluate(NgramDrafter(table=table), target, prompts, a.num_draft, a.max_new_tokens, temp)
            row[f"tau_T{temp:g}"] = round(ev["tau"], 3)
            row[f"acceptance_T{temp:g}"] = [round(x, 3) for x in ev["acceptance"]]
        rows.append(row)
        print(row, flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"target": a.target, "machine": cpu_kind(), "prompts": len(prompts), "K": a.num_draft}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# ngram-table: served tau against regenerated answers ({a.target})",
        "",
        f"Machine: {meta['machine']}. {len(prompts)} held-out prompts, K {a.num_draft} fixed, "
        f"{a.max_new_tokens} new tokens; tables counted from the first n answers.",
        "",
        f"Command: `python benchmarks/ngram_table_scaling.py --data {a.data} --eval-data {a.eval_data} "
        f"--sizes {a.sizes} --min-counts {a.min_counts} --prompts {a.prompts} --out {a.out}`",
        "",
        "| answers | min count | tokens | contexts | tau greedy | tau T=1 | acceptance k=1..3 (greedy) |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        acc = " / ".join(f"{x:.2f}" for x in r["acceptance_T0"][:3])
        size = f"| {r['answers']:,} | {r['min_count']} | {r['tokens']:,} | {r['contexts']:,} "
        lines.append(size + f"| {r['tau_T0']:.2f} | {r['tau_T1']:.2f} | {acc} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in dict.fromkeys(r["min_count"] for r in rows):
        sel = [r for r in rows if r["min_count"] == m]
        xs = [r["answers"] for r in sel]
        ax.plot(xs, [r["tau_T0"] for r in sel], "o-", label=f"greedy, min count {m}")
        ax.plot(xs, [r["tau_T1"] for r in sel], "s-", label=f"T = 1, min count {m}")
    ax.set_xscale("log")
    ax.set_xlabel("regenerated answers counted")
    ax.set_ylabel("served tau")
    ax.set_title(f"ngram-table, {a.target}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
