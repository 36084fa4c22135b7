"""EAGLE-2 trees at T > 0: trees of point-mass siblings against sampled chains, interleaved.

One process, one loaded target; per prompt (the bench categories, chat template) it decodes with
`ar`, then `eagle-tree` drafting trees at T > 0 (`TreeSpec.when_sampling="tree"`), `eagle-tree`
drafting sampled chains under a policy blind to their cut (it reads K up to the tree's node count,
`AdaptiveK.sampled_k_max` = K_max), `eagle-tree` as shipped (sampled chains of at most the tree's
depth, a policy that knows it) and the `eagle` chain, in alternating order
per prompt, each with the default adaptive policy and the same seed. A cell's speed-up is the
median over its prompts and repeats of the per-prompt tokens/s over `ar`'s (geometric mean over
categories). The drafting-cost profile is the shipped variant's (measured once per machine).
Usage:

    python benchmarks/bench_tree_sampling.py --target smollm2-135m --temperature 1 --limit 4 \
        --repeats 2 --out benchmarks/results/tree-sampling-<name>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections import defaultdict
from pathlib import Path

from specdecode.bench import hardware
from specdecode.build import LoadOptions, build
from specdecode.config import SamplingParams
from specdecode.datasets import load_categories
from specdecode.models.loader import load_model
from specdecode.request import GenerationRequest

CATEGORIES = ("chat", "code", "math", "summarization", "rag")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=4, help="prompts per category")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    tgt = load_model(a.target, dtype="auto")
    variants = {
        "ar": build(LoadOptions(tgt, "ar")),
        "eagle-tree (trees at T > 0)": build(LoadOptions(tgt, "eagle-tree")),
        "eagle-tree (chains, policy blind to the cut)": build(LoadOptions(tgt, "eagle-tree")),
        "eagle-tree (shipped: chains at T > 0)": build(LoadOptions(tgt, "eagle-tree")),
        "eagle (chain)": build(LoadOptions(tgt, "eagle")),
    }
    old = variants["eagle-tree (trees at T > 0)"].drafter
    old.tree = dataclasses.replace(old.tree, when_sampling="tree")
    old.sampled_k_max = None  # trees of up to K nodes at every temperature ...
    pol = variants["eagle-tree (trees at T > 0)"].decoder.policy
    pol.sampled_k_max = pol.k_max  # ... and a policy that reads them so
    blind = variants["eagle-tree (chains, policy blind to the cut)"].decoder.policy
    blind.sampled_k_max = blind.k_max
    tok = tgt.tokenizer
    items = [
        (c, tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=True)["input_ids"])
        for c in CATEGORIES
        for it in load_categories([c], limit=a.limit)[: a.limit]
    ]
    params = SamplingParams(temperature=a.temperature)
    for sd in variants.values():  # warm-up, not recorded
        sd.decoder.generate([GenerationRequest(items[0][1], params, 16, seed=0, id="warm")])
    tps: dict = defaultdict(list)  # (variant, prompt index) -> tokens/s over repeats
    taus: dict = defaultdict(list)  # (variant, category) -> tau
    names = list(variants)
    for rep in range(a.repeats):
        for i, (cat, ids) in enumerate(items):
            order = names if (rep + i) % 2 == 0 else [names[0], *reversed(names[1:])]
            for name in order:
                r = variants[name].decoder.generate(
                    [GenerationRequest(ids, params, a.max_new_tokens, seed=i, id=str(i))]
                )[0]
                tps[(name, i)].append(len(r.token_ids) / r.decode_time_s)
                taus[(name, cat)].append(r.tau)
    table = {}
    for name in names[1:]:
        row = {}
        for c in CATEGORIES:
            ratios = [
                x / y
                for i, (cc, _) in enumerate(items)
                if cc == c
                for x, y in zip(tps[(name, i)], tps[("ar", i)], strict=True)
            ]
            row[c] = {"speedup": statistics.median(ratios), "tau": statistics.median(taus[(name, c)])}
        row["geo-mean"] = statistics.geometric_mean([row[c]["speedup"] for c in CATEGORIES])
        table[name] = row
    info = hardware.machine_info()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(a), "machine": info, "table": table}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"# EAGLE-2 trees at T = {a.temperature}: trees against sampled chains ({a.target})",
        "",
        f"Machine: {info.get('cpu')} (native bf16 GEMM: {info.get('bf16_gemm')}), "
        f"{info.get('threads')} threads.",
        f"{a.limit} prompts a category x {a.repeats} repeats, {a.max_new_tokens} new tokens, adaptive "
        "policy; speed-up over `ar` in the same process, per prompt, interleaved (tau in brackets).",
        "",
        "| variant | " + " | ".join(CATEGORIES) + " | geo-mean |",
        "|---" * (len(CATEGORIES) + 2) + "|",
    ]
    for name, row in table.items():
        cells = [f"{row[c]['speedup']:.2f}x ({row[c]['tau']:.2f})" for c in CATEGORIES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['geo-mean']:.2f}x |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
