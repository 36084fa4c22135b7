"""Int8-stored drafters in their own int8 weights (`int8w`) or in the target's formats, paired against `ar`.

Every shipped drafter stores its matrices as int8 with a scale per row. On CPU, `load_net` runs
such a drafter's products of up to `formats.DRAFT_ROWS` rows in our `int8w` kernel wherever it is
measured faster than the target plan's kernel (`formats.int8_drafter_plan`); this runs `ar`, then
each method both ways (`int8 plan`: as shipped; `target's formats`: the plan the drafter ran in
before), on the same prompts in one process, paired per prompt (specdecode.bench.paired: order
alternating, one warm-up pass), at a fixed K per method (`--methods name:K,...`) or the default
adaptive policy (`name` alone). Greedy by default. Quiet machine needed (timing).

Usage: python benchmarks/drafter_formats_ab.py --methods eagle:4,mtp:3 --limit 4 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.bench.paired import add_paired_arguments, paired_rows, paired_runs, write_paired_report
from specdecode.build import LoadOptions, build
from specdecode.datasets import load_category
from specdecode.drafters import checkpoint
from specdecode.models.loader import load_model
from specdecode.training.regen import prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_paired_arguments(ap, datasets="code,chat", limit=4, temperature=0.0)
    ap.add_argument("--methods", default="eagle:4,mtp:3,dspark:7,dflash:6,medusa:4")
    a = ap.parse_args()
    target = load_model(a.target, dtype="auto")
    decoders = {"ar": build(LoadOptions(target, "ar")).decoder}
    plans = {}
    for spec in a.methods.split(","):
        method, _, k = spec.partition(":")
        policy = {"policy": "fixed", "num_draft_tokens": int(k)} if k else {}
        name = f"{method} K {k}" if k else method
        for label, loading in (
            ("int8 plan", contextlib.nullcontext),
            ("target's formats", checkpoint.in_target_formats),
        ):
            with loading():
                dec = build(LoadOptions(target, method, **policy)).decoder
            plans[f"{name}, {label}"] = dec.drafter.net.formats_plan.name
            decoders[f"{name}, {label}"] = dec
    cats = a.datasets.split(",")
    prompts = [(c, prompt_ids(target, r)) for c in cats for r in load_category(c, a.limit)]
    rows = paired_rows(paired_runs(decoders, prompts, a.temperature, a.max_new_tokens, a.repeats), cats)
    for r in rows:
        r["plan"] = plans[r["decoder"]]
        print(json.dumps(r), flush=True)
    setting = "; drafter plans: " + "; ".join(f"{k}: `{v}`" for k, v in plans.items())
    title = f"Int8-stored drafters in int8w or in the target's formats, on {a.target}"
    write_paired_report(Path(a.out), title, "drafter_formats_ab.py", a, cpu_kind(), setting, rows, "drafter")


if __name__ == "__main__":
    main()
