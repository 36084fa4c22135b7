"""Prompt lookup with and without its short-match caps, paired against `ar` in one process.

`ngram` (and `ngram-table`'s context matches) draft at most `SHORT_MATCH_DRAFTS[n]` tokens after
a match of only n tokens (1: 1, 2: 2; benchmarks/ngram_ceiling.py measured how rarely such
matches are followed for long); this runs `ar`, `--method` as shipped and with no cap
(`short_match_drafts={}`, every match drafts up to the policy's K) on the same prompts, paired
per prompt (specdecode.bench.paired: order alternating, one warm-up pass), greedy by default,
the default adaptive policy or, with `--k`, a fixed K (as a `num_speculative_tokens` setting
would run it). Quiet machine needed (timing).

Usage: python benchmarks/ngram_caps_ab.py [--method ngram-table] --datasets code,chat --limit 8 --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.bench.paired import add_paired_arguments, paired_rows, paired_runs, write_paired_report
from specdecode.build import LoadOptions, build
from specdecode.datasets import load_category
from specdecode.drafters.ngram import SHORT_MATCH_DRAFTS
from specdecode.models.loader import load_model
from specdecode.training.regen import prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_paired_arguments(ap, datasets="code,chat,summarization,rag,math", limit=8, temperature=0.0)
    ap.add_argument("--method", default="ngram", choices=("ngram", "ngram-table"))
    ap.add_argument("--k", type=int, default=None, help="fixed K (default: the adaptive policy)")
    a = ap.parse_args()
    target = load_model(a.target, dtype="auto")
    decoders = {"ar": build(LoadOptions(target, "ar")).decoder}
    policy = {} if a.k is None else {"policy": "fixed", "num_draft_tokens": a.k}
    capped = build(LoadOptions(target, a.method, **policy)).decoder
    decoders[f"{a.method}, caps " + json.dumps(SHORT_MATCH_DRAFTS)] = capped
    uncapped = build(LoadOptions(target, a.method, **policy)).decoder
    uncapped.drafter.caps = {}
    decoders[f"{a.method}, no cap"] = uncapped
    cats = a.datasets.split(",")
    prompts = [(c, prompt_ids(target, r)) for c in cats for r in load_category(c, a.limit)]
    rows = paired_rows(paired_runs(decoders, prompts, a.temperature, a.max_new_tokens, a.repeats), cats)
    for r in rows:
        print(json.dumps(r), flush=True)
    setting = f", {f'fixed K {a.k}' if a.k else 'default adaptive'} policy"
    title = f"Prompt lookup's short-match caps: {a.method} on {a.target}"
    write_paired_report(Path(a.out), title, "ngram_caps_ab.py", a, cpu_kind(), setting, rows, "drafter")


if __name__ == "__main__":
    main()
