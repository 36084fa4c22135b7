"""Draft time per round against block size: DFlash (one parallel forward) and DSpark (the same
forward plus a sequential Markov pass), next to the target's verify step for the same tokens.

The DFlash paper's claim: a block-diffusion drafter's per-round cost is flat in the block size,
so a bigger block costs nothing extra to draft. This script measures it on this machine: for each
block size B, one request with a ~`--context`-token prompt, `propose` timed `--repeats` times after
warm-up (median), with the drafter's block set to B (the same trained weights; only the timing is
of interest here, not the acceptance). The target column is one forward of B new tokens.

Usage: python benchmarks/bench_block_size.py --out benchmarks/results/block-size-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdecode.config import SamplingParams
from specdecode.drafter import DraftRow
from specdecode.drafters import build_drafter
from specdecode.models.loader import load_model
from specdecode.policy.profile import measure_step_costs
from specdecode.training.features import TargetFeatures


def time_propose(drafter, target, prompt: list[int], block: int, repeats: int) -> float:
    net = drafter.net
    net.cfg.block_size = block
    if hasattr(net, "sts_temperature") and len(net.sts_temperature) < block:
        net.sts_temperature = torch.ones(block, dtype=net.sts_temperature.dtype)
        net.sts_bias = torch.zeros(block, dtype=net.sts_bias.dtype)
    layers = tuple(dict.fromkeys(net.cfg.feature_layers))
    ids = torch.tensor(prompt)[None]
    feats = TargetFeatures(target, layers)({"input_ids": ids, "lengths": torch.tensor([len(prompt)])})
    drafter.setup(1, len(prompt) + 64)
    drafter.start(0, prompt, {i: feats[i][0, : len(prompt) - 1] for i in layers})
    row = DraftRow(0, prompt, SamplingParams(), torch.Generator().manual_seed(0))
    k = net.cfg.num_drafts
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        drafter.propose([row], [k])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", default="dflash,dspark")
    ap.add_argument("--blocks", default="2,4,8,12,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    target = load_model(a.target, dtype=a.dtype)
    prompt = torch.randint(100, target.vocab_size, (a.context,)).tolist()
    blocks = [int(b) for b in a.blocks.split(",")]
    rows = []
    verify = measure_step_costs(target.model, max(blocks))
    for m in a.methods.split(","):
        drafter = build_drafter(m, target)
        for b in blocks:
            rows.append(
                {
                    "method": m,
                    "block": b,
                    "draft_ms": 1000 * time_propose(drafter, target, prompt, b, a.repeats),
                }
            )
    for b in blocks:
        rows.append({"method": "target verify", "block": b, "draft_ms": 1000 * verify[b - 1]})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "target": a.target,
        "dtype": a.dtype,
        "context": a.context,
        "repeats": a.repeats,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        "# Draft time per round vs block size",
        "",
        f"Target {a.target} ({a.dtype}), one request, {a.context}-token context, median of {a.repeats} "
        f"rounds after warm-up; {meta['threads']} threads, CPU capability {meta['cpu_capability']}, "
        f"torch {meta['torch']}. `target verify` = one target forward of B new tokens. Command: "
        f"`python benchmarks/bench_block_size.py --out {a.out}`.",
        "",
        "| block size B | " + " | ".join(f"{m} (ms)" for m in methods) + " |",
        "|---:|" + "---:|" * len(methods),
    ]
    for b in blocks:
        vals = [next(r["draft_ms"] for r in rows if r["method"] == m and r["block"] == b) for m in methods]
        lines.append(f"| {b} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    for m in methods:
        v = [r["draft_ms"] for r in rows if r["method"] == m]
        lines.append(f"\n{m}: B = {blocks[-1]} costs {v[-1] / v[0]:.2f}x B = {blocks[0]}.")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        ax.plot(blocks, [r["draft_ms"] for r in rows if r["method"] == m], marker="o", label=m)
    ax.set_xlabel("block size B (tokens per round)")
    ax.set_ylabel("ms per round")
    ax.set_title("Draft time per round vs block size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "block_size.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
