"""DSpark's confidence head offline: teacher-forced confidences against the acceptance probability
they are trained to predict, on regenerated answers sampled at different temperatures.

For each drafter (`--drafter NAME=DIR`) and each answer set (`--data NAME=DIR`, regenerated data
with a held-out split), `training.calibrate.offline_calibration` runs the drafter's training task
over the held-out answers (no gradient) and reports per draft position the mean raw confidence
(sigmoid of the head's logit, no STS), the mean label 1 - TV(p_d, p_t) at T = 1 and the ECE of the
one against the other. The label is the acceptance probability of rejection sampling at T = 1 on
those contexts, without the sampling noise of served rounds: a head calibrated here and
mis-calibrated in `specdecode calibrate` is seeing other contexts there. Usage:

    python benchmarks/confidence_offline.py --target smollm2-135m \\
        --drafter shipped=specdecode/data/drafters/smollm2-135m-dspark \\
        --data t0.7=runs/data/regen-t07 --data t1=runs/data/regen-t1 --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.hardware import machine_info
from specdecode.drafters.checkpoint import load_checkpoint
from specdecode.models.loader import load_model
from specdecode.training.calibrate import offline_calibration
from specdecode.training.data import load_sequences
from specdecode.training.run import make_task, trainable, warm_start, with_vocabulary
from specdecode.training.trainer import TrainConfig


def task_for(path: str, target, seqs, work: Path):
    """The DSpark training task holding the checkpoint's weights (its own architecture options)."""
    arch, state = load_checkpoint(path, "dspark", target)
    options = trainable("dspark").train_options
    kw = with_vocabulary({k: arch[k] for k in options if k in arch}, state) | {"init_from_target": False}
    task = make_task("dspark", target, seqs, work, TrainConfig(out_dir=str(work)), kw)
    warm_start(task, path, arch, state)
    return task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", required=True, help="NAME=DIR (a DSpark checkpoint)")
    ap.add_argument("--data", action="append", required=True, help="NAME=DIR (regenerated, with heldout)")
    ap.add_argument("--max-batches", type=int, default=40)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(a.target)
    results = {"machine": machine_info(), "target": a.target, "rows": []}
    lines = [
        f"# DSpark confidence head offline ({a.target})",
        "",
        "Teacher-forced on held-out regenerated answers; confidence = sigmoid of the raw head (no STS); "
        "label = 1 - TV(p_d, p_t) at T = 1 (the acceptance probability of rejection sampling); ECE of "
        f"the one against the other, 20 bins; {a.max_batches} batches of {a.tokens_per_batch} tokens "
        "at most.",
        "",
        "| drafter | answers | position | labels | mean confidence | mean label | ECE |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for d_name, d_dir in (s.split("=", 1) for s in a.drafter):
        for s_name, s_dir in (s.split("=", 1) for s in a.data):
            seqs = load_sequences(s_dir, "heldout", 512, target.fingerprint)
            task = task_for(d_dir, target, seqs, out / "work")
            for r in offline_calibration(task, target, seqs, a.tokens_per_batch, a.max_batches):
                results["rows"].append({"drafter": d_name, "answers": s_name, **r})
                lines.append(
                    f"| {d_name} | {s_name} | {r['position']} | {r['n']} | {r['confidence']:.3f} "
                    f"| {r['label']:.3f} | {100 * r['ece']:.2f} % |"
                )
    cmd = " ".join(f"--drafter {d}" for d in a.drafter) + " " + " ".join(f"--data {d}" for d in a.data)
    lines += ["", f"Command: `python benchmarks/confidence_offline.py --target {a.target} {cmd}`."]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
