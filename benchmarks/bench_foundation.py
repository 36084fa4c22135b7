"""Foundation benchmark: our ar / ngram / draft beside transformers generate, assisted generation
and prompt lookup, on the same prompts in the same process.

Measures end-to-end tokens/s (prefill + decode, new tokens only), tau, and speed-ups over our
`ar`, on MT-Bench first turns and HumanEval prompts (chat template applied), greedy. Methods
run round-robin per prompt after a warm-up, so slow drifts of a noisy machine hit all of them
alike; every figure is a median over prompts (of `--repeats` runs each). Writes a markdown
report and the raw rows as JSON.

    python benchmarks/bench_foundation.py --target smollm2-135m --limit 8 \
        --out benchmarks/results/foundation-smollm2-135m
    python benchmarks/bench_foundation.py --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b \
        --methods ar,ngram,draft --peers hf,hf-assisted --limit 4 --out benchmarks/results/foundation-qwen
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

import specdecode
from specdecode.bench.harness import TransformersPeer
from specdecode.datasets import load_prompt_set
from specdecode.models.loader import load_model, resolve_path


def prompts_for(name: str, limit: int) -> list[dict]:
    recs = load_prompt_set(name)
    if name == "mt-bench":
        return [{"id": f"mt-{r['question_id']}", "text": r["turns"][0]} for r in recs[:limit]]
    if name == "humaneval":
        return [
            {
                "id": r["task_id"],
                "text": "Complete this Python function.\n\n```python\n" + r["prompt"] + "```",
            }
            for r in recs[:limit]
        ]
    raise SystemExit(f"unknown dataset {name!r}; choose mt-bench or humaneval")


def _peer_row(r: dict) -> dict:
    n = r["num_new_tokens"]
    return {
        "tokens": r["token_ids"],
        "n": n,
        "time": r["prefill_time_s"] + r["decode_time_s"] * (n - 1) / max(n, 1),
        "decode": r["decode_time_s"],
        "tau": None,
    }


def run_ours(sd, ids: list[int], max_new: int) -> dict:
    from specdecode.decode import GenerationRequest

    r = sd.decoder.generate([GenerationRequest(ids, max_new_tokens=max_new)])[0]
    return {
        "tokens": r.token_ids,
        "n": r.num_new_tokens,
        "time": r.prefill_time_s + r.decode_time_s,
        "decode": r.decode_time_s,
        "tau": r.tau,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="draft model for `draft` and `hf-assisted`")
    ap.add_argument("--methods", default="ar,ngram")
    ap.add_argument("--peers", default="hf,hf-lookup")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "int8", "int4"])
    ap.add_argument("--peer-dtype", default="bf16", choices=["bf16", "fp32"], help="transformers' dtype")
    ap.add_argument("--out", required=True, help="output path prefix (writes .md and .json)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.peer_dtype == "bf16" else torch.float32
    methods = [m for m in a.methods.split(",") if m]
    peers = [p for p in a.peers.split(",") if p]

    target = load_model(a.target, dtype=a.dtype, device="cpu")
    ours = {
        m: specdecode.load(target, m, a.drafter if m == "draft" else None, dtype=a.dtype, device="cpu")
        for m in methods
    }
    drafter_dir = resolve_path(a.drafter) if "hf-assisted" in peers else None  # its path, nothing loaded
    hf = {p: TransformersPeer(p, target.path, drafter_dir, dtype) for p in peers}
    runners = {m: (lambda ids, n, sd=sd: run_ours(sd, ids, n)) for m, sd in ours.items()}
    runners.update({p: (lambda ids, n, peer=peer: _peer_row(peer.run(ids, n))) for p, peer in hf.items()})

    tok = target.tokenizer
    rows = []
    for ds in a.datasets.split(","):
        items = prompts_for(ds, a.limit)
        for j, item in enumerate(items):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": item["text"]}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
            if j == 0:  # warm-up, not recorded
                for run in runners.values():
                    run(ids, 16)
            for rep in range(a.repeats):
                res = {name: run(ids, a.max_new_tokens) for name, run in runners.items()}
                for name, r in res.items():
                    rows.append(
                        {
                            "dataset": ds,
                            "prompt": item["id"],
                            "repeat": rep,
                            "method": name,
                            "tokens": r["n"],
                            "time_s": r["time"],
                            "decode_s": r["decode"],
                            "e2e_tokens_per_s": r["n"] / r["time"],
                            "tokens_per_s": r["n"] / r["decode"],
                            "tau": r["tau"],
                            "same_as_ar": r["tokens"] == res["ar"]["tokens"] if "ar" in res else None,
                        }
                    )
                print(
                    f"{ds} {item['id']} rep{rep}: "
                    + ", ".join(
                        f"{n} {r['n'] / r['decode']:.1f} tok/s" + (f" tau {r['tau']:.2f}" if r["tau"] else "")
                        for n, r in res.items()
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    Path(f"{out}.md").write_text(report(a, rows, list(runners), target.model.info.format or a.dtype))
    print(Path(f"{out}.md").read_text())


def _cpu_name() -> str:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = "AMX" if "amx_bf16" in info else "AVX512-BF16" if "avx512_bf16" in info else "no native bf16 GEMM"
    return f"{name} ({flags})"


def report(a, rows: list[dict], names: list[str], formats: str) -> str:
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    lines = [
        f"# Foundation benchmark: {a.target}" + (f" (drafter {a.drafter})" if a.drafter else ""),
        "",
        f"Greedy, {a.max_new_tokens} new tokens max, ours --dtype {a.dtype} (formats: "
        f"{formats}), transformers {a.peer_dtype}, CPU ({torch.get_num_threads()} threads), "
        f"chat template, first {a.limit} prompts per set, {a.repeats} repeat(s). Decode tokens/s "
        "excludes prefill (transformers: total minus a separately timed 1-token generate); end-to-end "
        "includes it. Speed-up = median over prompts of (method decode tok/s / our ar decode tok/s) for "
        "the same prompt and repeat. `hf*` rows are transformers `generate` (plain, assisted with the "
        "same draft model, prompt lookup with 10 tokens), same process. Machine: "
        f"{_cpu_name()}.",
        "",
        f"Command: `python benchmarks/bench_foundation.py {' '.join(sys.argv[1:])}`",
        "",
        f"Libraries: torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, Python {platform.python_version()}.",
        "",
        "| method | dataset | decode tok/s | end-to-end tok/s | tau | speed-up vs ar | same tokens as ar |",
        "|---|---|---|---|---|---|---|",
    ]
    for ds in datasets:
        ar = {
            (r["prompt"], r["repeat"]): r["tokens_per_s"]
            for r in rows
            if r["dataset"] == ds and r["method"] == "ar"
        }
        for name in names:
            rs = [r for r in rows if r["dataset"] == ds and r["method"] == name]
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            e2e = statistics.median(r["e2e_tokens_per_s"] for r in rs)
            taus = [r["tau"] for r in rs if r["tau"] is not None]
            tau = f"{statistics.median(taus):.2f}" if taus else "-"
            sp = [
                r["tokens_per_s"] / ar[(r["prompt"], r["repeat"])]
                for r in rs
                if (r["prompt"], r["repeat"]) in ar
            ]
            speed = f"{statistics.median(sp):.2f}x" if sp else "-"
            same = sum(bool(r["same_as_ar"]) for r in rs)
            lines.append(f"| {name} | {ds} | {tps:.1f} | {e2e:.1f} | {tau} | {speed} | {same}/{len(rs)} |")
    lines += ["", "Raw rows: the `.json` file beside this report.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
