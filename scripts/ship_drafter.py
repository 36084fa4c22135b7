"""Copy a trained drafter into the package (specdecode/data/drafters/<name>/) with a model card.

Usage: python scripts/ship_drafter.py RUN_DIR NAME [--data REGEN_DIR] [--note TEXT]
The card is written from the checkpoint's config.json (method, architecture, target, training
steps, wall-clock) and the run's log.jsonl (served tau and per-position acceptance of the last
evaluation); the weights are copied as they are (bf16 safetensors). Refuses files over 40 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "specdecode" / "data" / "drafters"
LIMIT_MB = 40


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("name")
    ap.add_argument("--data", default=None, help="the regenerated data directory it was trained on")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    run, dst = Path(a.run), ROOT / a.name
    cfg = json.loads((run / "config.json").read_text())
    size = (run / "model.safetensors").stat().st_size / 2**20
    if size > LIMIT_MB:
        raise SystemExit(f"{run}/model.safetensors is {size:.1f} MB, over the {LIMIT_MB} MB limit")
    evals = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if "eval_tau" in x]
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(run / "config.json", dst / "config.json")
    shutil.copy(run / "model.safetensors", dst / "model.safetensors")
    for extra in ("calibration.json", "reliability.png"):  # DSpark after `specdecode calibrate`
        if (run / extra).exists():
            shutil.copy(run / extra, dst / extra)
    tr = cfg["training"]
    data = ""
    if a.data:
        meta = json.loads((Path(a.data) / "meta.json").read_text())
        data = (
            f"- Data: {tr['num_sequences']} prompts of `specdecode data build` answered by the target itself "
            f"(`specdecode data regen`, temperature {meta['temperature']}, "
            f"up to {meta['max_new_tokens']} new tokens), {tr['num_tokens']} tokens in all.\n"
        )
    last = evals[-1] if evals else {}
    lines = [
        f"# {a.name}: {cfg['method']} drafter for {cfg['target']['name']}",
        "",
        f"- Method: `{cfg['method']}`; architecture: `{json.dumps(cfg['arch'])}`",
        f"- Target: {cfg['target']['name']} (fingerprint `{cfg['target']['fingerprint']}`); loading it for "
        "another target is refused.",
        data.rstrip("\n") if data else "- Data: see the training config.",
        f"- Training: {tr['steps']} steps, {tr['wall_clock_s']:.0f} s wall-clock on a CPU machine "
        f"(world size {tr.get('world_size', 1)}); config `{json.dumps(tr['config'])}`",
        f"- Served tau (real speculative loop, greedy, K = {tr['config']['eval_num_draft']}, "
        f"{tr['config']['eval_prompts']} held-out prompts, "
        f"{tr['config']['eval_max_new_tokens']} new tokens): "
        f"{last.get('eval_tau', 'n/a')}; per-position acceptance {last.get('eval_acceptance', 'n/a')}",
        f"- Weights: bf16 safetensors, {size:.1f} MB.",
    ]
    if "calibration" in cfg:
        c = cfg["calibration"]
        lines.append(
            f"- Confidence calibration (`specdecode calibrate`, {c.get('method', 'sts')}): temperatures "
            f"{c['sts_temperature']}, biases {c.get('sts_bias', 0)}, fit on {c['rounds_fit']} rounds of "
            f"{c['prompts']} held-out prompts at T = {c['temperature']}; per-position ECE and AUROC in "
            "calibration.json, reliability plot reliability.png."
        )
    if a.note:
        lines += ["", a.note]
    (dst / "README.md").write_text("\n".join(lines) + "\n")
    print(f"shipped {dst} ({size:.1f} MB)")


if __name__ == "__main__":
    main()
