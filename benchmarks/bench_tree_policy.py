"""How the adaptive policy sizes a tree method's rounds: draft-length policies side by side, paired.

One process loads the target and the method once; each prompt is decoded under every policy
in turn (the order reversed every other repeat, the first pass a warm-up), so machine noise hits
the policies alike. Policies:
- `adaptive`: the default policy; a nested tree (`Proposal.nested`, DSpark's and DFlash's trees)
  sized per node from the rate at which each of its best-first nodes was accepted (`tree_tau`);
- `as-chain`: the same policy reading each tree round as a chain of the tree's depth, as it read
  every tree before per-node sizing (and still reads other trees): the baseline of the ratios;
- `fixed:K`: K nodes every round; `off`: no drafts (plain decoding through the same loop).
Per category: tokens/s (all tokens over all decode time), mean tau, drafts per round, and the
median over prompts and repeats of each policy's speed over `as-chain` on the same prompt
(with the 10th-90th percentile of those ratios). Writes `<out>/report.md` and `<out>/results.json`.

    python benchmarks/bench_tree_policy.py --method dspark-tree-lookup --fixed 8 \
        --datasets chat,code,math,summarization,rag --limit 4 --repeats 2 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.build import LoadOptions, build
from specdecode.config import SamplingParams
from specdecode.datasets import load_category
from specdecode.policy import AdaptiveK, FixedK
from specdecode.policy.base import DraftPolicy
from specdecode.request import GenerationRequest
from specdecode.training.regen import prompt_ids

BASE = "as-chain"


class AsChain(AdaptiveK):
    """AdaptiveK reading a nested tree's round as a chain of its depth (DraftPolicy's default)."""

    def observe_tree(self, state, num_nodes, depth, accepted_nodes):
        DraftPolicy.observe_tree(self, state, num_nodes, depth, accepted_nodes)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--method", default="dspark-tree-lookup")
    ap.add_argument("--fixed", default="", help="comma-separated node budgets run as fixed:K")
    ap.add_argument("--datasets", default="chat,code,math,summarization,rag")
    ap.add_argument("--limit", type=int, default=4, help="prompts per category")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes (after one warm-up pass)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    sd = build(LoadOptions(a.target, a.method))
    tgt, adaptive = sd.target, sd.decoder.policy
    if not isinstance(adaptive, AdaptiveK):
        raise SystemExit(f"{a.method}: the default policy is {type(adaptive).__name__}, not AdaptiveK")
    as_chain = copy.deepcopy(adaptive)
    as_chain.__class__ = AsChain
    pols: dict[str, DraftPolicy] = {"adaptive": adaptive, BASE: as_chain}
    pols.update({f"fixed:{k}": FixedK(int(k)) for k in a.fixed.split(",") if k})
    pols["off"] = FixedK(0)
    cats = a.datasets.split(",")
    prompts = [(c, prompt_ids(tgt, r)) for c in cats for r in load_category(c, a.limit)]
    runs: dict[str, list[dict]] = defaultdict(list)
    for rep in range(a.repeats + 1):
        names = list(pols) if rep % 2 == 0 else list(reversed(pols))
        for i, (cat, ids) in enumerate(prompts):
            for name in names:
                sd.decoder.policy = pols[name]
                params = SamplingParams(temperature=a.temperature)
                req = GenerationRequest(ids, params, a.max_new_tokens, seed=rep)
                out = sd.decoder.generate([req])[0]
                if rep:  # the first pass warms up
                    runs[name].append(
                        {
                            "category": cat,
                            "prompt": i,
                            "repeat": rep,
                            "seconds": out.decode_time_s,
                            "tokens": out.num_new_tokens,
                            "steps": out.num_steps,
                            "tau": out.tau,
                            "drafted": out.num_drafted,
                        }  # fmt: skip
                    )
        print(f"pass {rep} done", file=sys.stderr, flush=True)

    def cell(name: str, cat: str) -> dict:
        rs = [r for r in runs[name] if r["category"] == cat]
        base = [r for r in runs[BASE] if r["category"] == cat]
        pairs = zip(rs, base, strict=True)
        ratios = [(b["seconds"] / b["tokens"]) / (r["seconds"] / r["tokens"]) for r, b in pairs]
        return {
            "tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
            "tau": statistics.mean(r["tau"] for r in rs),
            "drafts_per_round": sum(r["drafted"] for r in rs) / max(sum(r["steps"] for r in rs), 1),
            "vs_base": statistics.median(ratios),
            "vs_base_p10": _pct(ratios, 0.1),
            "vs_base_p90": _pct(ratios, 0.9),
        }

    table = {name: {cat: cell(name, cat) for cat in cats} for name in pols}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"settings": vars(a), "machine": cpu_kind(), "table": table, "runs": runs}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    cmd = (
        f"python benchmarks/bench_tree_policy.py --method {a.method} --fixed {a.fixed or '-'} --datasets "
        f"{a.datasets} --limit {a.limit} --repeats {a.repeats} --max-new-tokens {a.max_new_tokens} "
        f"--temperature {a.temperature} --out DIR"
    )
    lines = [
        f"# Tree sizing: draft-length policies for `{a.method}` ({a.target}, T = {a.temperature})",
        "",
        f"Machine: {cpu_kind()}. Command: `{cmd}`. One process, each prompt decoded under every",
        f"policy in turn ({a.repeats} timed passes after a warm-up, order reversed every other pass).",
        "",
        f"Cell: tokens/s, speed over `{BASE}` on the same prompts (median of the paired ratios,",
        "10th-90th percentile), mean tau, drafts (nodes) per round.",
        "",
        "| policy | " + " | ".join(cats) + " |",
        "|---|" + "---|" * len(cats),
    ]
    for name in pols:
        cells = []
        for cat in cats:
            c = table[name][cat]
            spread = f"{c['vs_base_p10']:.2f}-{c['vs_base_p90']:.2f}"
            cells.append(
                f"{c['tokens_per_s']:.1f} tok/s, {c['vs_base']:.3f}x ({spread}), "
                f"tau {c['tau']:.2f}, {c['drafts_per_round']:.1f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
