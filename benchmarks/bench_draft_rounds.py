"""What a drafting round costs at fixed K, in target decode steps: the runtime issue's bounds
(a DFlash/DSpark round <= 0.2 step; EAGLE-3 and MTP <= 0.08 step per draft token; Medusa <= 0.03).

One process: the target with `ar` and every method at fixed K (greedy, chat template) decode the
same prompts, interleaved per prompt (ar, then each method), for `--repeats` passes. A round's
cost is the decoder's drafting time (`draft_time`: catch-up on the tokens committed since the
last round included; the prompt itself is read at prefill, `Drafter.prefill`) per step, as
`build` times rounds for the adaptive policy;
the step is `ar`'s decode time per token (prefill excluded) on the same prompt, just before;
per draft token divides a round by the drafts it made (fewer than K where a drafter stops
early: MTP drafts at most one token per module, and here from its full depth on, not by its
depth rule).
The report gives medians over prompts and passes, and the paired ratio round / step; beside it
the speed-up measured on the prompt (ar's decode time / the method's, same tokens) and the one
the cost model predicts at tau = 3 with the same K: 3 steps' worth of tokens per round that
costs the round plus its verify pass (both measured here; neither depends on tau at fixed K),
3 x step / (round + verify). `--compare-formats` also loads each method with its drafter in the
target's formats (`checkpoint.in_target_formats`: what an int8-stored drafter ran in before it read
its own int8 weights), interleaved with the others, so both rows come from one run. Usage:

    python benchmarks/bench_draft_rounds.py --methods eagle:4,eagle-tree:16,dspark:7,dflash:6 \
        [--drafter eagle=DIR ...] --out benchmarks/results/draft-rounds-<name>
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch

from specdecode import load
from specdecode.bench.hardware import machine_info
from specdecode.drafters import checkpoint

PROMPTS = [
    "Explain what a hash table is in three sentences.",
    "Give me three tips for writing a clear email to a colleague.",
    "Write a Python function that checks whether a number is prime.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number",
]
BOUNDS = {"dflash": ("round", 0.2), "dspark": ("round", 0.2), "eagle": ("token", 0.08),
          "eagle-tree": ("token", 0.08), "mtp": ("token", 0.08), "medusa": ("token", 0.03)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", required=True, help="METHOD:K,... e.g. eagle:4,dspark:7")
    ap.add_argument("--drafter", action="append", default=[], help="METHOD=DIR (default: the shipped one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (T > 0: rounds draw q, verify by rejection)",
    )
    ap.add_argument(
        "--compare-formats",
        action="store_true",
        help="also run each method's drafter in the target's formats (not its int8 plan)",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    drafters = dict(s.split("=", 1) for s in a.drafter)
    specs = [(m, int(k), m) for m, k in (s.split(":") for s in a.methods.split(","))]  # (label, K, method)
    if a.compare_formats:
        specs = [x for m, k, _ in specs for x in ((m, k, m), (f"{m}, target's formats", k, m))]
    ar = load(a.target, method="ar")
    sds = {}
    for label, k, m in specs:  # label != m: the drafter in the target's formats
        with checkpoint.in_target_formats() if label != m else contextlib.nullcontext():
            sds[label] = load(
                ar.target, method=m, drafter=drafters.get(m), policy="fixed", num_draft_tokens=k
            )
    for label, _, m in specs:  # MTP drafts K from the first round (its depth rule would start at 1)
        if m == "mtp":
            sds[label].decoder.drafter.start_depth = len(sds[label].decoder.drafter.net.mods)
    plans = {
        label: getattr(getattr(sd.decoder.drafter, "net", None), "formats_plan", None)
        for label, sd in sds.items()
    }
    for sd in (ar, *sds.values()):
        sd.generate(PROMPTS[0], max_new_tokens=8, chat=True)  # warm-up
    rows = {m: [] for m in sds}  # per (pass, prompt): (round s, step s, tau, verify s, speed-up)
    for _ in range(a.repeats):
        for p in PROMPTS:
            r = ar.generate(p, max_new_tokens=a.tokens, chat=True, temperature=a.temperature)
            step = r.decode_time_s / max(r.num_new_tokens, 1)
            for m, sd in sds.items():
                sd.decoder.draft_time = sd.decoder.verify_time = 0.0
                res = sd.generate(p, max_new_tokens=a.tokens, chat=True, temperature=a.temperature)
                n, dec = max(res.num_steps, 1), sd.decoder
                speedup = step * res.num_new_tokens / res.decode_time_s if res.decode_time_s else float("nan")
                drafted = res.num_drafted / n  # drafts per round (MTP: at most its modules)
                rows[m].append((dec.draft_time / n, step, res.tau, dec.verify_time / n, speedup, drafted))
    info = machine_info()
    machine = f"{info.get('cpu', '?')} (native bf16 GEMM: {info.get('bf16_gemm', '?')})"
    report = {"machine": info, "target": a.target, "tokens": a.tokens, "repeats": a.repeats, "methods": {}}
    lines = [
        f"# Drafting round cost at fixed K ({a.target})",
        "",
        f"Machine: {machine}, {torch.get_num_threads()} threads; torch {torch.__version__}. "
        f"{len(PROMPTS)} prompts (chat template, {f'T = {a.temperature:g}' if a.temperature else 'greedy'}), "
        f"{a.tokens} new tokens, {a.repeats} passes; "
        "medians over prompts and passes. Step: `ar` decode time per token on the same prompt just "
        "before (prefill excluded).",
        "",
        "| method | K | drafts a round | round ms | ar step ms | round / step | per draft token / step "
        "| bound | tau | verify / step | speed-up | at tau 3 (model) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, k, m in specs:
        rs = rows[label]
        ratio = statistics.median(r / s for r, s, *_ in rs)  # paired per prompt
        verify = statistics.median(v / s for _, s, _, v, *_ in rs)
        at3 = statistics.median(3 * s / (r + v) for r, s, _, v, *_ in rs)
        drafted = statistics.median(r[5] for r in rs)
        per_token = statistics.median(r / s / max(d, 1e-9) for r, s, *_, d in rs)
        kind, bound = BOUNDS.get(m, ("round", float("nan")))
        shown = f"{bound} a {kind}" if bound == bound else ""
        rec = {
            "k": k,
            "round_ms": statistics.median(r[0] for r in rs) * 1e3,
            "step_ms": statistics.median(r[1] for r in rs) * 1e3,
            "round_per_step": ratio,
            "drafts_per_round": drafted,
            "per_token_per_step": per_token,
            "tau": statistics.median(r[2] for r in rs),
            "verify_per_step": verify,
            "speedup": statistics.median(r[4] for r in rs),
            "speedup_at_tau3": at3,
            "drafter_plan": None if plans[label] is None else plans[label].name,
        }
        report["methods"][label] = rec
        lines.append(
            f"| {label} | {k} | {drafted:.1f} | {rec['round_ms']:.2f} | {rec['step_ms']:.2f} | {ratio:.3f} "
            f"| {per_token:.3f} | {shown} | {rec['tau']:.2f} | {verify:.2f} | {rec['speedup']:.2f}x "
            f"| {at3:.2f}x |"
        )
    shown = {lab: p.name for lab, p in plans.items() if p is not None}
    lines += ["", "Drafter format plans: " + "; ".join(f"{lab} `{n}`" for lab, n in shown.items()) + "."]
    lines += ["", "Command: `python benchmarks/bench_draft_rounds.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
        if k not in ("drafter", "out", "compare_formats")
    ) + (" --compare-formats" if a.compare_formats else "") + "`" + (
        " with drafters " + ", ".join(a.drafter) if a.drafter else "") + "."]  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
