"""Load benchmark of `specdecode serve`: throughput vs per-user speed at rising concurrency.

For each method (default: `ar`; n-gram with a fixed K; n-gram with the confidence scheduler) a
server is started as a child process (same target, dtype, max batch and context), warmed up;
then each level drives every server in turn (alternating order, so background load drifts hit
all methods alike) over loopback with `concurrency` streaming chat clients at 1, 2, 4, 8, 16, 32,
with real prompts from the benchmark datasets (specdecode/datasets/categories.py), `ignore_eos` so
every request generates `--max-tokens`. Writes results.json, report.md and frontier.png (throughput
vs per-user tokens/s, one curve per method, points labelled by concurrency, as in DSpark).

    OMP_NUM_THREADS=1 python benchmarks/bench_serve.py            # SmolLM2-135M, ~20 min on a busy 2-core CPU
    python benchmarks/bench_serve.py --concurrency 1 2 --requests 4 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdecode.bench.serve import ServerProcess, run_level, scrape, tau_acceptance
from specdecode.datasets import load_categories

# label -> (method, policy, K)
METHODS = {
    "ar": ("ar", "fixed", 0),
    "ngram-fixed-k4": ("ngram", "fixed", 4),
    "ngram-scheduled": ("ngram", "scheduled", 4),
    # DSpark's own confidences drive the scheduler (the shipped drafter of the target).
    "dspark-scheduled": ("dspark", "scheduled", 7),
    "dspark-fixed-k7": ("dspark", "fixed", 7),
}

LOG_DIR = Path(tempfile.gettempdir()) / "specdecode-serve-logs"  # server logs (not committed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", nargs="+", default=list(METHODS)[:3], choices=list(METHODS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--requests", type=int, default=8, help="requests per level: max(this, concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--datasets", default="all")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per category")
    ap.add_argument("--out", default="benchmarks/results/serve-smollm2-135m")
    ap.add_argument("--report-only", action="store_true", help="rewrite report.md from results.json")
    return ap.parse_args()


def _sps_table(settings: dict) -> list[str]:
    """The step-time profile the scheduled server used (read back from the cache: same key)."""
    scheduled = [m for m in settings["methods"] if METHODS[m][1].startswith("scheduled")]
    if not scheduled:
        return []
    from specdecode.models.loader import load_model
    from specdecode.policy import StepCostModel

    k = METHODS[scheduled[0]][2]
    target = load_model(settings["target"], dtype=settings["dtype"])
    cost = StepCostModel.measured(target, settings["max_batch"], k + 1, settings["max_model_len"])
    lines = [
        f"Measured target step time in ms (the profile the scheduler reads; context {cost.contexts[0]}):",
        "",
        "| requests / tokens each | " + " | ".join(str(b) for b in cost.blocks) + " |",
        "|---" * (len(cost.blocks) + 1) + "|",
    ]
    for r, line in zip(cost.rows, cost.times[0], strict=True):
        lines.append(f"| {r} | " + " | ".join(f"{1000 * t:.0f}" for t in line) + " |")
    extra = ", ".join(
        f"{r} requests {100 * (line[1] / line[0] - 1):+.0f} %"
        for r, line in zip(cost.rows, cost.times[0], strict=True)
    )
    lines += ["", f"Cost of one draft token per request (2 tokens vs 1 per row): {extra}."]
    return [*lines, ""]


def _prompts(datasets: str, limit: int) -> list[list[dict]]:
    items = load_categories(datasets, limit)
    # Interleave categories so every level sees a mix of chat, code, math, summaries and RAG.
    by_cat: dict[str, list[dict]] = {}
    for it in items:
        by_cat.setdefault(it["category"], []).append(it)
    mixed = [it for group in zip(*by_cat.values(), strict=False) for it in group]
    return [it["messages"] for it in mixed]


def main() -> int:
    a = _args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.report_only:
        data = json.loads((out / "results.json").read_text())
        write_report(out, data["settings"], data["meta"], data["runs"])
        print((out / "report.md").read_text())
        return 0
    prompts = _prompts(a.datasets, a.prompts)
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "report_only")}
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "num_prompts": len(prompts),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_at_start": round(os.getloadavg()[0], 2),  # other work on the machine
        "cpu_count": os.cpu_count(),
    }
    rows = []
    with contextlib.ExitStack() as stack:
        # All servers run side by side (idle ones cost nothing) and each level measures the
        # methods back to back, in alternating order, so drifting background load on a shared
        # machine hits every method alike.
        servers = {}
        for label in a.methods:
            method, policy, k = METHODS[label]
            args = [
                "--target",
                a.target,
                "--method",
                method,
                "--policy",
                policy,
                "--num-draft-tokens",
                str(k),
            ]
            args += [
                "--max-batch",
                str(a.max_batch),
                "--max-model-len",
                str(a.max_model_len),
                "--dtype",
                a.dtype,
            ]
            args += ["--served-model-name", "bench", "--max-queue", str(4 * max(a.concurrency))]
            args += ["--log-level", "warning"]
            t0 = time.time()
            servers[label] = stack.enter_context(
                ServerProcess(args, _free_port(), LOG_DIR / f"bench-server-{label}.log")
            )
            print(f"[{label}] server up in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
            run_level(servers[label].url, "bench", prompts, 2, 2, max_tokens=8, temperature=a.temperature)
        for i, c in enumerate(a.concurrency):
            for label in a.methods if i % 2 == 0 else a.methods[::-1]:
                srv = servers[label]
                before = scrape(srv.url)
                res = run_level(srv.url, "bench", prompts, c, max(a.requests, c), a.max_tokens, a.temperature)
                res.tau, res.acceptance = tau_acceptance(before, scrape(srv.url))
                rows.append({"method": label, **res.to_json()})
                print(
                    f"[{label}] c={c:3d} {res.throughput:7.1f} tok/s, {res.per_user_tps:6.1f} tok/s/user, "
                    f"TTFT p50 {res.ttft_p50_s:.2f}s, tau {res.tau or 1:.2f}, errors {res.errors}",
                    file=sys.stderr,
                    flush=True,
                )
                (out / "results.json").write_text(
                    json.dumps({"settings": settings, "meta": meta, "runs": rows}, indent=1)
                )
    for label, srv in servers.items():
        print(f"[{label}] server exit code {srv.returncode}", file=sys.stderr)
    write_report(out, settings, meta, rows)
    print((out / "report.md").read_text())
    return 0


def write_report(out: Path, settings: dict, meta: dict, rows: list[dict]) -> None:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["method"], r["concurrency"]): r for r in rows}
    lines = [
        f"# specdecode serve: load benchmark ({settings['target']}, {settings['dtype']})",
        "",
        f"Machine: {meta['machine']} ({meta['cpu_capability']}), {meta['threads']} torch threads; "
        f"torch {meta['torch']}, Python {meta['python']}; run {meta['date']}; {meta.get('cpu_count')} cores, "
        f"load average {meta.get('load_average_at_start')} when the run started (other jobs shared the CPU).",
        f"Streaming chat requests over loopback, {settings['max_tokens']} new tokens each (ignore_eos), "
        f"T = {settings['temperature']}, max({settings['requests']}, concurrency) requests per level, "
        f"{meta['num_prompts']} prompts from the benchmark datasets ({settings['datasets']}); server "
        f"--max-batch {settings['max_batch']}, --max-model-len {settings['max_model_len']}.",
        "Methods: "
        + ", ".join(f"`{m}`" for m in methods)
        + " (method, policy, K in benchmarks/bench_serve.py).",
        "",
        "Throughput = completion tokens / wall time of the level; per-user = median over requests of "
        "(tokens - 1) / (last token - first token); TTFT = median time to the first streamed token.",
        "",
        "| method | concurrency | throughput tok/s | vs ar | per-user tok/s | TTFT p50 s | TTFT p90 s "
        "| tau | acceptance | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        for c in levels:
            r = by.get((m, c))
            if r is None:
                continue
            ar = by.get(("ar", c))
            ratio = f"{r['throughput'] / ar['throughput']:.2f}x" if ar and ar["throughput"] else ""
            acc = f"{r['acceptance']:.2f}" if r.get("acceptance") is not None else ""
            lines.append(
                f"| {m} | {c} | {r['throughput']:.1f} | {ratio} | {r['per_user_tps']:.1f} | "
                f"{r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {(r.get('tau') or 1):.2f} | {acc} "
                f"| {r['errors']} |"
            )
    lines.append("")
    for sched in [m for m in methods if m.endswith("-scheduled")] if "ar" in methods else []:
        ratios = {
            c: by[(sched, c)]["throughput"] / by[("ar", c)]["throughput"]
            for c in levels
            if (sched, c) in by and ("ar", c) in by and by[("ar", c)]["throughput"]
        }
        if ratios:
            lo = min(ratios.values())
            at8 = ratios.get(8)
            lines.append(
                f"`{sched}` vs ar throughput: "
                + ", ".join(f"c={c}: {v:.2f}x" for c, v in ratios.items())
                + f". Lowest {lo:.2f}x"
                + (f"; at concurrency 8 {at8:.2f}x (target >= 1.5x)." if at8 is not None else ".")
            )
            idle = [v for c, v in ratios.items() if (by[(sched, c)].get("tau") or 1.0) < 1.005]
            if idle:
                lines.append(
                    f"Where nothing was admitted (tau 1.00) the spread {min(idle):.2f}x-{max(idle):.2f}x "
                    "around 1.00x is this machine's run-to-run noise plus the few rounds that drafted "
                    "anyway (probes that keep the acceptance or confidence estimates current; the "
                    "drafter does not run otherwise)."
                )
            lines.append("")
    try:
        lines += _sps_table(settings)
    except Exception as e:  # the report must not fail on a missing model or profile
        lines += [f"(step-time profile not available: {e})", ""]
    lines.append("Plot: `frontier.png` (throughput vs per-user tokens/s; labels are concurrency).")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plot(out, methods, levels, by)


def _plot(out: Path, methods, levels, by) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m in methods:
        pts = [(by[(m, c)]["per_user_tps"], by[(m, c)]["throughput"], c) for c in levels if (m, c) in by]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        for x, y, c in pts:
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Throughput vs per-user speed (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
