"""MTP frozen vs native (joint) mode: served tau, and how joint training moved the target's quality.

For each mode: the served tau of its MTP drafter in the real loop (greedy, fixed K, held-out
prompts of the regenerated data; frozen: the original target, native: the jointly trained one
written by `specdecode train mtp --mode native` under <native>/target). Quality: mean NLL per
token (and perplexity) of the original and the jointly trained target, transformers fp32, on
(a) the held-out responses of the regenerated data (the target's own outputs) and (b) real code
it never trained on: HumanEval prompts followed by their canonical solutions (NLL over the
solution tokens). Writes results.json and report.md.

    python benchmarks/bench_mtp_native.py --target smollm2-135m --data runs/data/regen-smollm2 \
        --frozen specdecode/data/drafters/smollm2-135m-mtp --native runs/drafters/mtp-native \
        --out benchmarks/results/mtp-native-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch


def _humaneval_seqs(tokenizer, limit: int):
    from specdecode.datasets import load_prompt_set
    from specdecode.training.data import Sequence

    seqs = []
    for rec in load_prompt_set("humaneval", progress=False)[:limit]:
        # Tokenized apart and concatenated, so the mask falls exactly on the solution's tokens.
        p = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
        sol = tokenizer(rec["canonical_solution"], add_special_tokens=False)["input_ids"]
        s, mask = p + sol, [0] * len(p) + [1] * len(sol)
        seqs.append(Sequence(torch.tensor(s), torch.tensor(mask)))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="regenerated data (held-out split used)")
    ap.add_argument("--frozen", required=True, help="frozen-mode MTP checkpoint")
    ap.add_argument("--native", required=True, help="native-mode output dir (drafter + target/)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for the served tau")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--humaneval", type=int, default=64, help="HumanEval solutions for the NLL")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default="benchmarks/results/mtp-native-smollm2-135m")
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from specdecode.drafters.mtp import load_mtp
    from specdecode.models.loader import load_model
    from specdecode.training.data import load_sequences
    from specdecode.training.methods.mtp import response_nll
    from specdecode.training.regen import read_regen
    from specdecode.training.trainer import evaluate

    t0 = time.time()
    orig = load_model(a.target, dtype=a.dtype, device="cpu")
    native_dir = Path(a.native) / "target"
    new = load_model(str(native_dir), dtype=a.dtype, device="cpu")
    held = read_regen(a.data, "heldout", orig.fingerprint)
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in held if 1 in r["loss_mask"]][: a.prompts]

    served = {}
    for mode, tgt, ckpt in (("frozen", orig, a.frozen), ("native", new, a.native)):
        r = evaluate(load_mtp(ckpt, tgt), tgt, prompts, a.num_draft, a.max_new_tokens)
        served[mode] = {"tau": r["tau"], "acceptance": r["acceptance"]}
        print(f"{mode}: served tau {r['tau']:.3f}")
    # The native drafter with the original target: how much of the gain is the trunk's.
    r = evaluate(load_mtp(a.native, orig), orig, prompts, a.num_draft, a.max_new_tokens)
    served["native-drafter-original-target"] = {"tau": r["tau"], "acceptance": r["acceptance"]}

    quality = {}
    held_seqs = load_sequences(a.data, "heldout", 512, orig.fingerprint)
    code_seqs = _humaneval_seqs(orig.tokenizer, a.humaneval)
    for name, path in (("original", orig.path), ("native", native_dir)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        quality[name] = {
            "heldout_nll": response_nll(model, held_seqs),
            "humaneval_nll": response_nll(model, code_seqs),
        }
        print(name, quality[name])
        del model

    ncfg = json.loads((Path(a.native) / "config.json").read_text())
    fcfg = json.loads((Path(a.frozen) / "config.json").read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {
        "target": a.target,
        "served": served,
        "quality": quality,
        "settings": {k: v for k, v in vars(a).items()},
        "training": {"frozen": fcfg.get("training", {}), "native": ncfg.get("training", {})},
        "num_heldout_prompts": len(prompts),
        "num_heldout_sequences": len(held_seqs),
        "num_humaneval": len(code_seqs),
        "wall_s": round(time.time() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps(res, indent=2))

    def tr(mode):
        t = res["training"][mode]
        c = t.get("config", {})
        return (
            f"{t.get('steps')} steps, lr {c.get('lr')}, {c.get('tokens_per_batch')} tokens/batch, "
            f"{t.get('wall_clock_s')} s"
        )

    q0, q1 = quality["original"], quality["native"]
    lines = [
        f"# MTP: frozen target vs native joint training ({a.target})",
        "",
        f"Machine: {platform.machine()}, torch {torch.__version__}; run {time.strftime('%Y-%m-%d %H:%M')}.",
        f"Command: `python benchmarks/bench_mtp_native.py --data {a.data} --frozen {a.frozen} "
        f"--native {a.native} --out {a.out}`",
        "",
        f"- frozen: modules only, on the frozen target ({tr('frozen')}).",
        f"- native: target + modules, L = L_main + {ncfg['training'].get('mtp_weight')} x L_MTP, "
        f"target at {ncfg['training'].get('config', {}).get('lr')} x "
        f"{ncfg['training'].get('trunk_lr_scale', '?')} ({tr('native')}).",
        "",
        f"## Served tau (greedy, K = {a.num_draft}, {len(prompts)} held-out prompts, "
        f"{a.max_new_tokens} tokens)",
        "",
        f"{ncfg['arch']['num_modules']} modules: at most {ncfg['arch']['num_modules']} drafts per step.",
        "",
        "| drafter | target | tau | acceptance per position |",
        "|---|---|---|---|",
    ]
    for mode, tname in (
        ("frozen", "original"),
        ("native", "jointly trained"),
        ("native-drafter-original-target", "original"),
    ):
        s = served[mode]
        # Positions past the number of modules are never drafted.
        acc = ", ".join(f"{x:.2f}" for x in s["acceptance"][: ncfg["arch"]["num_modules"]])
        lines.append(f"| {mode.split('-')[0]} | {tname} | {s['tau']:.3f} | {acc} |")
    lines += [
        "",
        "## Target quality (transformers fp32; lower is better)",
        "",
        "| text | original NLL (ppl) | jointly trained NLL (ppl) | change |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("heldout_nll", f"held-out responses ({len(held_seqs)}, the target's own outputs)"),
        ("humaneval_nll", f"HumanEval canonical solutions ({len(code_seqs)}, real code)"),
    ):
        lines.append(
            f"| {label} | {q0[key]:.4f} ({math.exp(q0[key]):.3f}) | {q1[key]:.4f} ({math.exp(q1[key]):.3f}) "
            f"| {100 * (math.exp(q1[key] - q0[key]) - 1):+.2f} % ppl |"
        )
    lines.append("")
    (out / "report.md").write_text("\n".join(lines))
    print(f"wrote {out}/report.md")


if __name__ == "__main__":
    main()
