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
import collections
import json
import statistics
from pathlib import Path

from bench_train import cpu_kind  # benchmarks/ is the script's directory

from specdecode.build import LoadOptions, build
from specdecode.config import SamplingParams
from specdecode.datasets import load_category
from specdecode.models.loader import load_model
from specdecode.request import GenerationRequest
from specdecode.training.regen import prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--method", default="dspark")
    ap.add_argument("--datasets", default="chat,rag,summarization")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--sampled-decays", default="0.9,0.95")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target = load_model(a.target, dtype="auto")
    decoders = {"ar": build(LoadOptions(target, "ar")).decoder}
    for d in (float(x) for x in a.sampled_decays.split(",")):
        dec = build(LoadOptions(target, a.method)).decoder
        dec.policy.sampled_decay = d
        decoders[f"sampled_decay {d:g}"] = dec
    cats = a.datasets.split(",")
    prompts = [(c, prompt_ids(target, r)) for c in cats for r in load_category(c, a.limit)]
    runs = collections.defaultdict(list)  # (decoder, category) -> [(s/token, tau, drafts/step)]
    names = list(decoders)
    for rep in range(a.repeats + 1):  # repeat 0 warms up
        for i, (cat, ids) in enumerate(prompts):
            for name in names if rep % 2 == 0 else names[::-1]:
                params = SamplingParams(temperature=a.temperature)
                req = GenerationRequest(ids, params, a.max_new_tokens, seed=1000 * rep + i)
                out = decoders[name].generate([req])[0]
                if rep:
                    steps = max(out.num_steps, 1)
                    runs[(name, cat)].append(
                        (out.decode_time_s / out.num_new_tokens, out.tau, out.num_drafted / steps)
                    )
    rows = []
    for cat in cats:
        base = runs[("ar", cat)]
        for name in names[1:]:
            got = runs[(name, cat)]
            speedup = statistics.median(b[0] / g[0] for b, g in zip(base, got, strict=True))
            tau = statistics.mean(g[1] for g in got)
            drafts = statistics.mean(g[2] for g in got)
            rows.append({"category": cat, "decoder": name, "speedup": speedup, "tau": tau, "drafts": drafts})
            print(json.dumps(rows[-1]), flush=True)
    cmd = "python benchmarks/policy_ab.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"
    )
    lines = [
        f"# The adaptive policy's memory for sampled requests: {a.method} on {a.target}",
        "",
        f"Machine: {cpu_kind()}. T = {a.temperature:g}, {a.max_new_tokens} new tokens, the first {a.limit} "
        f"prompts of each category, {a.repeats} repeats after a warm-up, every decoder in one process "
        "(paired per prompt and repeat, order alternating). Speed-up: median over prompts of `ar`'s "
        "time per token over the decoder's; tau and drafts per step: means over requests.",
        "",
        f"Command: `{cmd}`",
        "",
        "| category | policy | speed-up over ar | tau | drafts / step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['category']} | {r['decoder']} | {r['speedup']:.3f}x | {r['tau']:.2f} | {r['drafts']:.2f} |"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
