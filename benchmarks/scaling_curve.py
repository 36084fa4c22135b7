"""What data buys: served tau of DSpark, DFlash and EAGLE-3 against the number of regenerated
sequences they were trained on, at the same compute for every point or with compute growing
with the data.

For each size n of `--sizes` (`all` = every training sequence): the first n sequences of a seeded
shuffle of the regenerated answers (smaller sets are prefixes of larger ones) go to a run
directory, the methods train side by side from scratch on it (`specdecode train A,B,C`: one
target forward per step) for `--steps` steps of `--tokens-per-batch` tokens, and each drafter is
served in the real speculative loop on the held-out prompts (fixed K, greedy and T = 1): tau and
acceptance per draft position. Points already in OUT.json are skipped, and a killed training
resumes (checkpoints every 20 steps), so the curve grows across sessions. `--steps` is one
number (the same compute at every size) or one per size, `300:150,3000:300,all:1200` (compute
growing with the data). A run is keyed by sequences and steps, so a point both series share is
trained once and listed in each. OUT.md and OUT.png are rewritten from all points, beside
the published points (other targets, other compute: context, not a comparison).

Usage: OMP_NUM_THREADS=2 python benchmarks/scaling_curve.py --data runs/data/regen-smollm2 \
           --eval-data runs/data/prompts --runs runs/scaling --out benchmarks/results/scaling-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.drafters import build_drafter
from specdecode.models.loader import load_model
from specdecode.training.calibrate import heldout_prompts
from specdecode.training.regen import META
from specdecode.training.run import run_training, trainable
from specdecode.training.trainer import TrainConfig, evaluate

PUBLISHED = [  # (label, sequences, tau): METHODS.md, DSpark's small-target recipes
    ("DSpark, Qwen3-0.6B, 1.6k samples", 1_600, 1.81),
    ("DSpark, Llama-3.2-1B, 100k samples x 3 epochs", 100_000, 3.15),
]


def subset(data: Path, n: int | None, dst: Path, seed: int) -> int:
    """Write the first n records of a seeded shuffle of data/train.jsonl into dst (a regen dir)."""
    lines = (data / "train.jsonl").read_text().splitlines()
    random.Random(seed).shuffle(lines)
    lines = lines if n is None else lines[:n]
    dst.mkdir(parents=True, exist_ok=True)
    if not (dst / "train.jsonl").exists():
        (dst / META).write_text((data / META).read_text())
        (dst / "train.jsonl").write_text("\n".join(lines) + "\n")
    return len(lines)


def steps_by_size(spec: str, sizes: list[str]) -> dict[str, int]:
    """`--steps`: one count for every size, or `size:steps,...` naming each size of `--sizes`."""
    if ":" not in spec:
        return {size: int(spec) for size in sizes}
    table = dict(item.split(":") for item in spec.split(","))
    missing = [size for size in sizes if size not in table]
    if missing:
        raise SystemExit(f"--steps names no step count for size(s) {', '.join(missing)}: add SIZE:STEPS")
    return {size: int(table[size]) for size in sizes}


def served(target, drafter, prompts, k: int, max_new: int, temperature: float) -> dict:
    r = evaluate(drafter, target, prompts, k, max_new, temperature)
    return {"tau": round(r["tau"], 3), "acceptance": [round(a, 3) for a in r["acceptance"]]}


def series_of(point: dict) -> str:
    """The curve a point belongs to: one step count for every size, or steps growing with data."""
    return point.get("series", f"{point['steps']} steps each")


def write_report(out: Path, points: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "# What data buys: served tau against regenerated sequences (benchmarks/scaling_curve.py)",
        "",
        "Each point trains from scratch (compute = steps x tokens per step: the same at every size in",
        "one series, growing with the data in the other); tau in the real speculative loop on",
        "held-out prompts, fixed K, greedy and T = 1.",
        "",
        "| sequences | method | series | steps | tokens/step | tau greedy | tau T=1 "
        "| acceptance per position (greedy) | train s | machine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(points, key=lambda p: (series_of(p), p["sequences"], p["method"])):
        lines.append(
            f"| {p['sequences']} | {p['method']} | {series_of(p)} | {p['steps']} | {p['tokens_per_batch']} "
            f"| {p['greedy']['tau']} | {p['t1']['tau']} | {p['greedy']['acceptance']} | {p['train_s']} "
            f"| {p['machine']} |"
        )
    lines += ["", "Published points (other targets and compute):", ""]
    lines += [f"- {label}: tau {tau} at {n:,} samples" for label, n, tau in PUBLISHED]
    cmds = sorted({p["command"] for p in points})
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in cmds]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    methods = sorted({p["method"] for p in points})
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    styles = {}  # series -> line style: the same-compute series solid, compute growing dashed
    for ax, key, title in ((axes[0], "greedy", "greedy"), (axes[1], "t1", "T = 1")):
        for m, series in sorted({(p["method"], series_of(p)) for p in points}):
            pts = sorted(
                (p for p in points if p["method"] == m and series_of(p) == series),
                key=lambda p: p["sequences"],
            )
            ls = styles.setdefault(series, "--" if "growing" in series else "-")
            ax.plot(
                [p["sequences"] for p in pts],
                [p[key]["tau"] for p in pts],
                marker="o",
                ls=ls,
                color=colors[m],
                label=f"{m}, {series}",
            )
        for label, n, tau in PUBLISHED:
            ax.scatter([n], [tau], marker="*", s=90, color="grey")
            ax.annotate(label, (n, tau), fontsize=6, xytext=(-120, 4), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("regenerated sequences")
        ax.set_title(f"served tau, {title} (K fixed)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("served tau")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def save(out: Path, points: list[dict]) -> None:
    """OUT.json with every point, then OUT.md and OUT.png drawn from them."""
    out.with_suffix(".json").write_text(json.dumps(points, indent=1) + "\n")
    write_report(out, points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="regen directory (train split)")
    ap.add_argument("--eval-data", required=True, help="prompt set with heldout.jsonl")
    ap.add_argument("--methods", default="dspark,dflash,eagle")
    ap.add_argument("--sizes", default="300,1000,3000,10000,all")
    ap.add_argument("--steps", default="150", help="steps per point, or SIZE:STEPS per size")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="runs/scaling", help="where the subsets and checkpoints go")
    ap.add_argument("--out", required=True, help="OUT.json (points, appended), OUT.md, OUT.png")
    a = ap.parse_args()
    out = Path(a.out)
    points = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
    target = load_model(a.target)
    prompts = heldout_prompts(a.eval_data, target, a.eval_prompts)
    methods = a.methods.split(",")
    cmd = "python benchmarks/scaling_curve.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("out",)
    )
    machine = cpu_kind()
    sizes = a.sizes.split(",")
    steps = steps_by_size(a.steps, sizes)
    for size in sizes:
        n = None if size == "all" else int(size)
        data = Path(a.runs) / f"data-{size}"
        count = subset(Path(a.data), n, data, a.seed)
        series = f"steps growing with data ({a.steps})" if ":" in a.steps else f"{steps[size]} steps each"
        todo, listed = [], False
        for m in methods:
            runs = [
                p
                for p in points
                if p["method"] == m
                and p["sequences"] == count
                and p["steps"] == steps[size]
                and p["tokens_per_batch"] == a.tokens_per_batch
                and p.get("lr", 1e-3) == a.lr  # points from before these keys: lr 1e-3, seed 0
                and p.get("seed", 0) == a.seed
            ]
            if not runs:
                todo.append(m)
            elif not any(series_of(p) == series for p in runs):
                points.append({**runs[0], "series": series})  # trained once, listed in both series
                listed = True
        if listed:
            save(out, points)
        if not todo:
            continue
        run_dir = Path(a.runs) / f"train-{size}-{steps[size]}"
        # one directory per method even when one is left (a rerun after a kill finds its run)
        one = todo[0] if len(todo) == 1 else None
        cfg = TrainConfig(
            out_dir=str(run_dir / one if one else run_dir),
            steps=steps[size],
            lr=a.lr,
            warmup_steps=max(1, steps[size] // 15),
            checkpoint_every=20,
            tokens_per_batch=a.tokens_per_batch,
            eval_prompts=0,
            seed=a.seed,
            bf16=True,
        )
        t0 = time.perf_counter()
        kw = {m: dict(trainable(m).train_options) for m in todo}  # `specdecode train` defaults
        run_training(",".join(todo), target, data, Path(cfg.out_dir), cfg, kw[one] if one else kw)
        train_s = round(time.perf_counter() - t0)
        for m in todo:
            drafter = build_drafter(m, target, str(run_dir / m))
            point = {
                "sequences": count,
                "method": m,
                "steps": steps[size],
                "tokens_per_batch": a.tokens_per_batch,
                "lr": a.lr,
                "seed": a.seed,
                "series": series,
                "greedy": served(target, drafter, prompts, a.num_draft, a.max_new_tokens, 0.0),
                "t1": served(target, drafter, prompts, a.num_draft, a.max_new_tokens, 1.0),
                "train_s": train_s,
                "machine": machine,
                "command": cmd,
            }
            print(json.dumps(point))
            points.append(point)
            save(out, points)


if __name__ == "__main__":
    main()
