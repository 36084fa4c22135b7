"""How far a quantized target's greedy output follows the full-precision one.

`--dtype int8|int4` loads another, smaller model (speculation is lossless with respect to that
model, not to the original). This measures how different it is: greedy decoding of the bench
prompts (chat template, `--limit` per category, `--max-new-tokens`, EOS ignored) with the target
in each of `--dtypes`, and per format the first position where its tokens leave `auto`'s
(`auto`'s own rounding against `fp32` is the yardstick). Writes OUT.md and OUT.json.

    python benchmarks/quantized_agreement.py --target smollm2-135m \
        --out benchmarks/results/quantized-agreement-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdecode.bench import hardware
from specdecode.build import LoadOptions, build
from specdecode.config import SamplingParams
from specdecode.datasets import load_categories
from specdecode.models.loader import load_model
from specdecode.request import GenerationRequest
from specdecode.training.regen import prompt_ids

CATEGORIES = ("chat", "code", "math", "summarization", "rag")


def first_divergence(a: list[int], b: list[int]) -> int:
    """Tokens the two outputs share from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtypes", default="fp32,int8,int4", help="compared with auto")
    ap.add_argument("--limit", type=int, default=4, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", required=True, help="path prefix of OUT.md / OUT.json")
    a = ap.parse_args()
    dtypes = ["auto", *a.dtypes.split(",")]
    sds = {d: build(LoadOptions(load_model(a.target, dtype=d), "ar")) for d in dtypes}
    items = [
        (c, prompt_ids(sds["auto"].target, it))
        for c in CATEGORIES
        for it in load_categories([c], limit=a.limit)[: a.limit]
    ]
    outs = {
        d: [
            sd.decoder.generate(
                [GenerationRequest(ids, SamplingParams(), a.max_new_tokens, id=str(i), ignore_eos=True)]
            )[0].token_ids
            for i, (_, ids) in enumerate(items)
        ]
        for d, sd in sds.items()
    }
    formats = {d: sds[d].target.model.info.format for d in dtypes}
    rows = {}
    for d in dtypes[1:]:
        shared = [first_divergence(x, y) for x, y in zip(outs["auto"], outs[d], strict=True)]
        rows[d] = {
            "runs_as": formats[d],
            "median_shared": statistics.median(shared),
            "identical": sum(s == a.max_new_tokens for s in shared),
            "shared": shared,
        }
    info = hardware.machine_info()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(a), "machine": info, "auto_runs_as": formats["auto"], "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"# Greedy agreement of quantized targets with `auto` ({a.target})",
        "",
        f"Machine: {info.get('cpu')} (native bf16 GEMM: {info.get('bf16_gemm')}), "
        f"{info.get('threads')} threads; "
        f"`auto` runs {formats['auto']}. {len(items)} bench prompts ({a.limit} a category, chat template), "
        f"{a.max_new_tokens} greedy tokens, EOS ignored.",
        "",
        "Command: `python benchmarks/quantized_agreement.py "
        f"--target {a.target} --dtypes {a.dtypes} --limit {a.limit} "
        f"--max-new-tokens {a.max_new_tokens} --out {a.out}`",
        "",
        "| --dtype | runs as | tokens shared with auto from the start (median) | identical | per prompt |",
        "|---|---|---:|---:|---|",
    ]
    for d, r in rows.items():
        per = " ".join(map(str, r["shared"]))
        lines.append(
            f"| {d} | {r['runs_as']} | {r['median_shared']:g} | {r['identical']} of {len(items)} | {per} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
