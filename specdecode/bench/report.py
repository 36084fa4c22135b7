"""Turn `results.json` rows into `report.md` and PNG plots.

Contract: `summarize(rows)` -> per (T, batch, method, category) medians of tokens/s, tau and
speed-up over `ar` (the speed-up of a row is its tokens/s over `ar`'s for the same prompt,
T, batch and repeat; a category's figure is the median, the overall one the geometric mean of
the category medians), with a distribution-free confidence interval of each category's median
(`median_ci`: order statistics of the paired ratios, scipy's `quantile_test`), so a cell below a
line can be told apart from a cell whose interval straddles it. `write_report(out, cfg, meta,
rows)` writes `report.md` with those tables, per-position conditional acceptance, draft/verify
time shares and the hardware limit, plus `speedup_T*.png`, `acceptance_T*.png` and
`time_share.png` (matplotlib, Agg backend).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


CI_LEVEL = 0.9  # confidence of the interval around each cell's median speed-up
LINE = 0.95  # the speed-up no method should fall below (the runtime issue's line)


def median_ci(xs: list[float], level: float = CI_LEVEL) -> tuple[float, float] | None:
    """A `level` confidence interval of the median of xs from their order statistics (no
    assumption on the distribution: the paired ratios of a noisy host are skewed); None where xs
    are too few for one (fewer than 5 at 0.9)."""
    from scipy.stats import quantile_test  # deferred: scipy comes with the `bench` extra

    if len(xs) < 2:
        return None
    ci = quantile_test(xs, q=statistics.median(xs), p=0.5).confidence_interval(confidence_level=level)
    lo, hi = float(ci.low), float(ci.high)
    return None if math.isnan(lo) or math.isnan(hi) else (lo, hi)


def summarize(rows: list[dict]) -> dict:
    """{(T, B): {method: {category: {"tps", "tau", "speedup", "ci", "n"}}}} plus "all" per
    method; "ci" is `median_ci` of the category's paired speed-ups (None where too few)."""
    ar = {
        (r["prompt_id"], r["temperature"], r["batch"], r["repeat"]): r["tokens_per_s"]
        for r in rows
        if r["method"] == "ar"
    }
    groups: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        groups[(r["temperature"], r["batch"])][r["method"]][r["category"]].append(r)
    out: dict = {}
    for cfg, methods in groups.items():
        out[cfg] = {}
        for m, cats in methods.items():
            out[cfg][m] = {}
            for c, rs in cats.items():
                sp = [
                    r["tokens_per_s"] / ar[k]
                    for r in rs
                    if (k := (r["prompt_id"], r["temperature"], r["batch"], r["repeat"])) in ar and ar[k] > 0
                ]
                taus = [r["tau"] for r in rs if r.get("tau") is not None]
                out[cfg][m][c] = {
                    "tps": statistics.median(r["tokens_per_s"] for r in rs),
                    "tau": statistics.median(taus) if taus else None,
                    "speedup": statistics.median(sp) if sp else None,
                    "ci": median_ci(sp),
                    "n": len(rs),
                }
            out[cfg][m]["all"] = {
                "speedup": _geomean([v["speedup"] for v in out[cfg][m].values() if v["speedup"]]),
                "tps": statistics.median(r["tokens_per_s"] for rs in cats.values() for r in rs),
            }
    return out


def acceptance_by_position(rows: list[dict], method: str, temperature: float) -> list[float]:
    acc: list[int] = []
    reach: list[int] = []
    for r in rows:
        if r["method"] != method or r["temperature"] != temperature or not r.get("reached_per_position"):
            continue
        for j, (a, n) in enumerate(zip(r["accepted_per_position"], r["reached_per_position"], strict=True)):
            if j >= len(acc):
                acc.append(0)
                reach.append(0)
            acc[j] += a
            reach[j] += n
    return [a / n if n else 0.0 for a, n in zip(acc, reach, strict=True)]


def _drift(meta: dict) -> str:
    """The bandwidth read again at the end of the run, where it was (an older run has none)."""
    end = meta.get("bandwidth_end_GBps")
    if end is None:
        return ""
    change = end / meta["bandwidth_GBps"] - 1
    return (
        f" At the end of the run it read {end:.1f} GB/s ({change:+.0%}): 'x ceiling' is against the "
        "start; a host whose speed drifts moves it, not the paired speed-ups."
    )


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def write_report(out: Path, cfg, meta: dict, rows: list[dict]) -> None:
    summ = summarize(rows)
    cats = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        f"# specdecode bench: {meta.get('target', cfg.target)} ({cfg.dtype})",
        "",
        f"Machine: {meta.get('cpu', '?')} (native bf16 GEMM: {meta.get('bf16_gemm', '?')}), "
        f"{meta.get('threads')} threads; torch {meta.get('torch')}, transformers {meta.get('transformers')}, "
        f"Python {meta.get('python')}.",
        f"Settings: methods {', '.join(cfg.methods)}; peers {', '.join(cfg.peers) or 'none'}; datasets "
        f"{cfg.datasets} (limit {cfg.limit}); max {cfg.max_new_tokens} new tokens; {cfg.repeats} repeat(s); "
        f"draft-length policy {cfg.policy}. Decode time excludes prefill; warm-up runs excluded; figures are "
        "medians over prompts (geometric mean over categories in the last column).",
        "",
        "## Hardware limit",
        "",
        f"Read bandwidth {meta['bandwidth_GBps']:.1f} GB/s, target weights {meta['weight_MB']:.0f} MB -> "
        f"batch-1 ceiling {meta['ar_ceiling_tokens_per_s']:.1f} tokens/s.{_drift(meta)}",
        "",
    ]
    ceiling = meta["ar_ceiling_tokens_per_s"]
    for (t, b), per in sorted(summ.items()):
        lines += [
            f"## T = {t}, batch {b}",
            "",
            "Speed-up over `ar` (tau in brackets); the last column gives tokens/s per request "
            "as a multiple of the ceiling.",
            "",
            "| method | " + " | ".join(cats) + " | geo-mean | x ceiling |",
            "|---" * (len(cats) + 3) + "|",
        ]
        for m in methods:
            if m not in per:
                continue
            cells = []
            for c in cats:
                v = per[m].get(c)
                if v is None:
                    cells.append("-")
                    continue
                tau = f" ({v['tau']:.2f})" if v["tau"] is not None else ""
                cells.append(f"{_fmt(v['speedup'], '.2f')}x{tau}")
            allv = per[m]["all"]
            lines.append(
                f"| {m} | "
                + " | ".join(cells)
                + f" | {_fmt(allv['speedup'], '.2f')}x | {allv['tps'] / ceiling:.2f} |"
            )
        lines += _interval_lines(per, methods, cats)
        lines += ["", "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
        for m in methods:
            if m in per:
                lines.append(
                    f"| {m} tokens/s | "
                    + " | ".join(_fmt(per[m].get(c, {}).get("tps"), ".1f") for c in cats)
                    + " |"
                )
        lines.append("")
    temps = sorted({r["temperature"] for r in rows})
    spec_methods = [m for m in methods if m != "ar" and not m.startswith("hf")]
    if spec_methods:
        lines += [
            "## Per-position conditional acceptance",
            "",
            "P(draft k accepted | drafts 1..k-1 accepted), pooled over all runs.",
            "",
            "| method | T | " + " | ".join(f"k={k}" for k in range(1, 9)) + " |",
            "|---" * 10 + "|",
        ]
        for m in spec_methods:
            for t in temps:
                acc = acceptance_by_position(rows, m, t)
                lines.append(
                    f"| {m} | {t} | "
                    + " | ".join(f"{a:.2f}" for a in acc[:8])
                    + " |" * max(1, 9 - min(len(acc), 8))
                )
        lines += [
            "",
            "## Where the time goes",
            "",
            "A round's drafting cost in `ar` steps (ms per `ar` decode step in the same run): the unit",
            "the cost bounds of the runtime issue use (e.g. a DFlash/DSpark round <= 0.2 step).",
            "",
            "| method | draft share | verify share | draft ms per round | draft tokens per round "
            "| round / ar step | per draft token / ar step |",
            "|---|---|---|---|---|---|---|",
        ]
        ar_rs = [r for r in rows if r["method"] == "ar" and r.get("num_steps")]
        ar_step = sum(r["decode_time_s"] for r in ar_rs) / max(sum(r["num_steps"] for r in ar_rs), 1)
        for m in methods:
            rs = [r for r in rows if r["method"] == m and "draft_time_s" in r]
            dec = sum(r["decode_time_s"] for r in rs)
            rounds = sum(r.get("num_steps", 0) for r in rs)
            if dec > 0:
                per_round = sum(r["draft_time_s"] for r in rs) / max(rounds, 1)
                drafted = sum(r.get("num_drafted", 0) for r in rs) / max(rounds, 1)
                ratio = per_round / ar_step if ar_step else float("nan")
                per_tok = ratio / drafted if drafted else float("nan")
                lines.append(
                    f"| {m} | {sum(r['draft_time_s'] for r in rs) / dec:.1%} | "
                    f"{sum(r['verify_time_s'] for r in rs) / dec:.1%} | {1000 * per_round:.2f} | "
                    f"{drafted:.1f} | {ratio:.3f} | {per_tok:.3f} |"
                )
        lines.append("")
    lines += ["Plots: " + ", ".join(f"`{p.name}`" for p in _plots(out, summ, rows, cats, methods, temps)), ""]
    (out / "report.md").write_text("\n".join(lines))


def _interval_lines(per: dict, methods: list[str], cats: list[str]) -> list[str]:
    """The confidence intervals of one (T, batch) table's cells, and which cells lie below LINE:
    wholly (the interval's top under it) or only at the median (the interval straddles it)."""
    spec = [m for m in methods if m in per and m != "ar"]
    if not spec:
        return []
    pct = f"{CI_LEVEL:.0%}"
    lines = [
        "",
        f"{pct} confidence interval of each cell's median speed-up (order statistics of its paired "
        "ratios; '-' where too few for one):",
        "",
        "| method | " + " | ".join(cats) + " |",
        "|---" * (len(cats) + 1) + "|",
    ]
    below, straddle = [], []
    for m in spec:
        cells = []
        for c in cats:
            v = per[m].get(c) or {}
            ci, sp = v.get("ci"), v.get("speedup")
            cells.append("-" if ci is None else f"{ci[0]:.2f}-{ci[1]:.2f}")
            if sp is not None and sp < LINE:
                name = f"{m} on {c} ({sp:.2f}x" + ("" if ci is None else f", {ci[0]:.2f}-{ci[1]:.2f}") + ")"
                (below if ci is not None and ci[1] < LINE else straddle).append(name)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Below {LINE}x with {pct} confidence: {', '.join(below) or 'none'}. "
        f"Median below {LINE}x, interval reaching above it: {', '.join(straddle) or 'none'}.",
    ]
    return lines


def _save(fig, path: Path) -> Path:
    # Deferred: matplotlib is an optional dependency (the `bench` extra), loaded by `_plots`.
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plots(out: Path, summ, rows, cats, methods, temps) -> list[Path]:
    # Deferred: matplotlib is an optional dependency (the `bench` extra); Agg before pyplot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for (t, b), per in sorted(summ.items()):
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cats)), 3.5))
        ms = [m for m in methods if m in per]
        w = 0.8 / max(len(ms), 1)
        for i, m in enumerate(ms):
            ys = [per[m].get(c, {}).get("speedup") or 0 for c in cats]
            ax.bar([j + i * w for j in range(len(cats))], ys, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cats))], cats)
        ax.set_ylabel("speed-up over ar")
        ax.set_title(f"T = {t}, batch {b}")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / f"speedup_T{t}_B{b}.png"))
    spec = [m for m in methods if m != "ar" and not m.startswith("hf")]
    for t in temps:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in spec:
            acc = acceptance_by_position(rows, m, t)
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("conditional acceptance")
        ax.set_ylim(0, 1)
        ax.set_title(f"T = {t}")
        if spec:
            ax.legend(fontsize=7)
        paths.append(_save(fig, out / f"acceptance_T{t}.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ours = [m for m in methods if not m.startswith("hf")]
    shares = []
    for m in ours:
        rs = [r for r in rows if r["method"] == m]
        dec = sum(r["decode_time_s"] for r in rs) or 1.0
        shares.append((sum(r["draft_time_s"] for r in rs) / dec, sum(r["verify_time_s"] for r in rs) / dec))
    ax.bar(ours, [s[0] for s in shares], label="draft")
    ax.bar(
        ours,
        [s[1] for s in shares],
        bottom=[s[0] for s in shares],
        label="verify (target forward + sampling)",
    )
    ax.set_ylabel("share of decode time")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "time_share.png"))
    return paths
