"""The adaptive policy's memory for sampled requests, paired against `ar` in one process.

One target; `ar` and one decoder per `--sampled-decays` value (the adaptive policy's
`sampled_decay`: how much of a sampled request's acceptance history a round keeps), each prompt
decoded by every decoder in turn (order reversed every repeat, one warm-up pass), the same seed
per prompt and repeat. Reports, per category, the median over prompts of the paired speed-up over
`ar`, tau (tokens per step) and drafts per step. Quiet machine needed (timing).

Usage: python benchmarks/policy_ab.py --method dspark --datasets chat,rag,summarization --limit 8 \
           --sampled-decays 0.9,0.95 --temperature 1 --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.bench.paired import add_paired_arguments, paired_rows, paired_runs, write_paired_report
from specdecode.build import LoadOptions, build
from specdecode.datasets import load_category
from specdecode.models.loader import load_model
from specdecode.training.regen import prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_paired_arguments(ap, datasets="chat,rag,summarization", limit=8, temperature=1.0)
    ap.add_argument("--method", default="dspark")
    ap.add_argument("--sampled-decays", default="0.9,0.95")
    a = ap.parse_args()
    target = load_model(a.target, dtype="auto")
    decoders = {"ar": build(LoadOptions(target, "ar")).decoder}
    for d in (float(x) for x in a.sampled_decays.split(",")):
        dec = build(LoadOptions(target, a.method)).decoder
        dec.policy.sampled_decay = d
        decoders[f"sampled_decay {d:g}"] = dec
    cats = a.datasets.split(",")
    prompts = [(c, prompt_ids(target, r)) for c in cats for r in load_category(c, a.limit)]
    runs = paired_runs(decoders, prompts, a.temperature, a.max_new_tokens, a.repeats)
    rows = paired_rows(runs, cats)
    for r in rows:
        print(json.dumps(r), flush=True)
    title = f"The adaptive policy's memory for sampled requests: {a.method} on {a.target}"
    write_paired_report(Path(a.out), title, "policy_ab.py", a, cpu_kind(), "", rows, "policy")


if __name__ == "__main__":
    main()
