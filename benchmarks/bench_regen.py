"""Regeneration throughput on this machine: what `specdecode data regen` writes per second, and where
a batched step's time goes.

For each batch size and KV-cache format, `regenerate` answers the same `--num-prompts` training
prompts `--samples` times (T 0.7, the campaign's settings) into a fresh directory after a short
warm-up run; answers/s and tokens/s are those regen reports (response tokens over wall-clock,
the tail where the batch drains included). With `--profile`, the last setting runs once more
under torch.profiler and its time is split into the products (linear layers and the head),
attention, sampling and the rest.

The ceiling column is what the machine's read bandwidth allows for the same answers: a step of
`batch` rows reads the weights once and each row's keys and values (every earlier position of
its prompt and answer), so tokens/s <= bandwidth * tokens / (tokens / batch * weight bytes +
sum over generated tokens of context * KV bytes per position). At batch 64 the KV reads of a
135M-parameter target outweigh its weights: that, not the products, bounds regeneration.

Usage: OMP_NUM_THREADS=2 python benchmarks/bench_regen.py --target smollm2-135m \
           --data runs/data/prompts --batch-sizes 16,64 --kv-cache-dtypes fp32,bf16 --profile \
           --out benchmarks/results/regen-smollm2-135m-amx
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdecode.bench.hardware import machine_info, measure_read_bandwidth, weight_bytes
from specdecode.models.loader import load_model
from specdecode.training.regen import regenerate

GROUPS = (  # profiler op name fragments -> where the time goes (first match wins)
    ("products", ("linear", "addmm", "aten::mm", "matmul", "_weight_int")),
    ("attention", ("attention", "sdpa", "_softmax_backward", "flash")),
    ("sampling", ("multinomial", "softmax", "sort", "topk", "cumsum", "exponential", "argmax")),
)


def _group(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "rest"


def _context_sum(out: Path) -> int:
    """Sum over generated tokens of the positions their step attends to (prompt + earlier answer)."""
    total = 0
    for line in (out / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        a = sum(r["loss_mask"])
        p = len(r["input_ids"]) - a
        total += a * p + a * (a - 1) // 2
    return total


def _kv_bytes_per_position(target) -> int:
    info = target.model.info
    dtype = getattr(target.model, "kv_dtype", None) or info.dtype  # what the native cache holds
    size = torch.empty(0, dtype=dtype).element_size()
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * size


def _run(target, args, batch: int, out: Path, share: bool = True) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return regenerate(
        target,
        args.data,
        out,
        splits=("train",),
        limit=args.num_prompts,
        samples=args.samples,
        batch_size=batch,
        max_new_tokens=args.max_new_tokens,
        temperature=0.7,
        seed=args.seed,
        progress=False,
        share_prefix=share,
    )


def _profile(target, args, batch: int, out: Path) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        summary = _run(target, args, batch, out)
    self_s = collections.Counter()
    for ev in prof.key_averages():
        self_s[_group(ev.key)] += ev.self_cpu_time_total / 1e6
    total = sum(self_s.values())
    return {"seconds": summary["seconds"], "share": {g: round(s / total, 3) for g, s in self_s.items()}}


def bench(args) -> dict:
    rows, prof = [], None
    bandwidth = measure_read_bandwidth()
    kvs, batches = args.kv_cache_dtypes.split(","), [int(b) for b in args.batch_sizes.split(",")]
    shares = [{"on": True, "off": False}[x] for x in args.share_prefix.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    try:
        for kv in kvs:
            target = load_model(args.target, dtype=args.dtype, kv_cache_dtype=kv)
            for batch, share in [(b, x) for b in batches for x in shares]:
                warm = argparse.Namespace(
                    **{**vars(args), "num_prompts": 4, "samples": 1, "max_new_tokens": 16}
                )
                _run(target, warm, batch, work / "warm")
                s = _run(target, args, batch, work / "run", share)
                read = s["tokens"] / batch * weight_bytes(target.model)
                read += _context_sum(work / "run") * _kv_bytes_per_position(target)
                ceiling = bandwidth * s["tokens"] / read
                rows.append(
                    {
                        "kv_cache_dtype": kv,
                        "batch_size": batch,
                        "share_prefix": share,
                        "shared_prompt_tokens": s["shared_prompt_tokens"],
                        "answers": s["answers"],
                        "tokens": s["tokens"],
                        "seconds": round(s["seconds"], 1),
                        "answers_per_s": round(s["answers"] / s["seconds"], 2),
                        "tokens_per_s": round(s["tokens"] / s["seconds"], 1),
                        "ceiling_tokens_per_s": round(ceiling, 1),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            if args.profile and kv == kvs[-1]:
                prof = {
                    "kv_cache_dtype": kv,
                    "batch_size": batch,
                    **_profile(target, args, batch, work / "prof"),
                }
                print(json.dumps(prof), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = {**machine_info(), "read_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
    return {"machine": info, "settings": vars(args), "rows": rows, "profile": prof}


def report(res: dict) -> str:
    m, s = res["machine"], res["settings"]
    lines = [
        f"# Regeneration throughput: {s['target']}",
        "",
        f"Machine: {m.get('cpu')} (bf16 products: {m.get('bf16_gemm')}), {m['threads']} threads; "
        f"{s['num_prompts']} training prompts x {s['samples']} samples, "
        f"T 0.7, up to {s['max_new_tokens']} new tokens, weights `--dtype {s['dtype']}`.",
        "",
        f"Read bandwidth measured here {m['read_bandwidth_gb_s']} GB/s.",
        "",
        "| KV cache | batch | prompt rows shared | answers | tokens | seconds | answers/s | tokens/s "
        "| ceiling tokens/s | x ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['batch_size']} "
            f"| {'on' if r.get('share_prefix') else 'off'} ({r.get('shared_prompt_tokens', 0)} copied) "
            f"| {r['answers']} | {r['tokens']} | {r['seconds']} "
            f"| {r['answers_per_s']} | {r['tokens_per_s']} | {r['ceiling_tokens_per_s']} "
            f"| {r['tokens_per_s'] / r['ceiling_tokens_per_s']:.2f} |"
        )
    p = res["profile"]
    if p:
        share = ", ".join(f"{g} {v:.0%}" for g, v in sorted(p["share"].items(), key=lambda kv: -kv[1]))
        lines += [
            "",
            f"Where the time goes (profiled run, KV {p['kv_cache_dtype']}, batch {p['batch_size']}): "
            f"{share}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="a prompt set (specdecode data build)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--kv-cache-dtypes", default="fp32,bf16")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--share-prefix", default="on", help="on, off or on,off: samples of a prompt copy its rows (A/B)"
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md are written")
    args = ap.parse_args()
    res = bench(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    text = report(res)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
