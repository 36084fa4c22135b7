"""Training throughput of the learned drafters on this machine: where a training step's time goes.

For each method, on the same batches of the regenerated data (`--tokens-per-batch` tokens each):
the frozen target's feature forward, the drafter's forward (loss included), its backward and the
optimiser step, each the median of `--repeats` steps after one warm-up step. Training tokens/s
counts the real (unpadded) tokens of a batch over the whole step.

`shared` times what `specdecode train A,B,...` does: one feature forward per batch (the union of
the methods' layers) read by every method's loss, so each method's step costs its own part plus
a share of the target.

Usage: OMP_NUM_THREADS=2 python benchmarks/bench_train.py --data runs/data/regen-smollm2 \
           --methods eagle,dspark,dflash --bf16 --label after --out benchmarks/results/train-smollm2-135m
(`--out` appends this run's rows to OUT.json and rewrites OUT.md from all rows.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specdecode.bench.hardware import machine_info
from specdecode.models.loader import load_model
from specdecode.training.data import collate, load_sequences, plan_batches
from specdecode.training.features import TargetFeatures
from specdecode.training.run import task_class
from specdecode.training.trainer import feature_union


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(args) -> list[dict]:
    torch.set_float32_matmul_precision("high")
    target = load_model(args.target, dtype=args.dtype)
    seqs = load_sequences(args.data, "train", args.max_len, target.fingerprint)[: args.num_sequences]
    plan = plan_batches([len(s.input_ids) for s in seqs], args.tokens_per_batch, 0, 0)
    batches = []
    for idx in plan[: args.repeats + 1]:
        b = collate([seqs[j] for j in idx])
        b["index"] = torch.tensor(idx)
        batches.append(b)
    methods = args.methods.split(",")
    tasks = {}
    for m in methods:
        torch.manual_seed(0)
        tasks[m] = task_class(m)(target, seqs)
    feats_of = TargetFeatures(target, feature_union(tasks.values()))
    opts = {
        m: torch.optim.AdamW([p for p in t.module.parameters() if p.requires_grad], lr=1e-5)
        for m, t in tasks.items()
    }
    parts: dict[str, dict[str, list[float]]] = {m: {"fwd": [], "bwd": [], "opt": []} for m in methods}
    feat_s, tokens = [], []
    for i, b in enumerate(batches):
        box = {}
        tf = _time(lambda b=b, box=box: box.update(f=feats_of(b)))
        for m, t in tasks.items():
            out = {}

            def fwd(t=t, b=b, out=out, box=box):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    out["loss"], _ = t.module(b, box["f"])

            tfw = _time(fwd)
            tbw = _time(lambda out=out: out["loss"].backward())
            top = _time(lambda m=m: (opts[m].step(), opts[m].zero_grad(set_to_none=True)))
            if i:  # the first batch warms up
                parts[m]["fwd"].append(tfw)
                parts[m]["bwd"].append(tbw)
                parts[m]["opt"].append(top)
        if i:
            feat_s.append(tf)
            tokens.append(int(b["lengths"].sum()))
    med = statistics.median
    f = med(feat_s)
    n_tok = med(tokens)
    own = {m: sum(med(v) for v in parts[m].values()) for m in methods}
    rows = []
    for m in methods:
        p = {k: round(med(v), 3) for k, v in parts[m].items()}
        alone = f + own[m]
        shared = f / len(methods) + own[m]
        rows.append(
            {
                "label": args.label,
                "method": m,
                "bf16": args.bf16,
                "features_s": round(f, 3),
                **{f"{k}_s": v for k, v in p.items()},
                "step_s": round(alone, 3),
                "tok_s": round(n_tok / alone, 1),
                "shared_with": len(methods),
                "shared_step_s": round(shared, 3),
                "shared_tok_s": round(n_tok / shared, 1),
            }
        )
    return rows


def cpu_kind() -> str:
    """The machine in a report row: CPU model, its bf16 GEMM kind, threads."""
    info = machine_info()
    return f"{info['cpu']} ({info.get('bf16_gemm', '?')}), {info['threads']} threads"


def write_report(out: Path, rows: list[dict]) -> None:
    cols = ("label", "method", "features s", "fwd s", "bwd s", "opt s", "step s", "tokens/s")
    head = "| " + " | ".join(cols + ("shared by", "step s shared", "tokens/s shared")) + " |"
    lines = [
        "# Drafter training throughput, SmolLM2-135M (benchmarks/bench_train.py)",
        "",
        "Median of the timed steps (one warm-up step first), ~4096-token batches of the regenerated",
        "data. `shared`: one target feature forward per batch for all the methods of the run",
        "(`specdecode train A,B,...`), each method's step charged an equal share of it (for runs",
        "of a commit before that command existed, the same arithmetic on that run's timings).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        keys = ("label", "method", "features_s", "fwd_s", "bwd_s", "opt_s", "step_s", "tok_s")
        keys += ("shared_with", "shared_step_s", "shared_tok_s")
        lines.append("| " + " | ".join(str(r[k]) for k in keys) + " |")
    runs = sorted({(r["label"], r["machine"], r["command"], r["commit"]) for r in rows})
    lines += ["", "Runs:", ""]
    lines += [f"- `{lb}` (commit {c}, {mc}): `{cmd}`" for lb, mc, cmd, c in runs]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="regen directory")
    ap.add_argument("--methods", default="eagle,dspark,dflash")
    ap.add_argument("--num-sequences", type=int, default=3000)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the drafter (as `train --bf16`)")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None, help="append rows to OUT.json, rewrite OUT.md")
    args = ap.parse_args()
    rows = bench(args)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = git.stdout.strip()
    cmd = "python benchmarks/bench_train.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k}"
        for k, v in vars(args).items()
        if k != "out" and v not in (None, False)
    )
    for r in rows:
        r |= {"machine": cpu_kind(), "command": cmd, "commit": commit}
        print(json.dumps(r))
    if args.out:
        out = Path(args.out)
        old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
        allrows = old + rows
        out.with_suffix(".json").write_text(json.dumps(allrows, indent=1) + "\n")
        write_report(out, allrows)


if __name__ == "__main__":
    main()
