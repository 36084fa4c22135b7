"""Offline vs served: a trained drafter's teacher-forced accuracy per draft position on held-out
regenerated data, beside its acceptance per position in the real speculative loop.

Contract:
- `offline_accuracy(task, target, seqs, tokens_per_batch, max_batches)` runs the task's own
  loss forward (eval mode, no gradient) over held-out sequences and averages its `acc_*` logs
  over the batches, keyed by 0-based draft position (`POSITION_OFFSET`: Medusa heads, MTP
  modules and the distilled draft model log `acc_k` for the k-th, which drafts position k - 1).
  What each task calls accuracy is its own: EAGLE-3 / Medusa / MTP / draft compare the
  drafter's argmax with the target's argmax at that position (what greedy serving accepts);
  DFlash / DSpark compare with the regenerated token there, which the target sampled.
- `compare(task, target, heldout_seqs, prompts, cfg)` adds the served acceptance (greedy,
  `cfg.eval_num_draft`, `cfg.eval_max_new_tokens`: `trainer.evaluate`) and returns
  `{"rows": [{"position", "offline", "served", "gap"}], "served_tau", "sequences", "prompts"}`;
  gap = offline - served in points. Served acceptance at position j is conditional on the
  drafts before it being accepted; under greedy decoding that prefix is the target's own, the
  same prefix teacher forcing gives, so the two should agree within a few points.
- `trained_state(run_dir, method)`: the trainer state (`trainer.pt`) of a training run, refused
  when there is none or it is another method's; its "module" holds the weights to load.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.training.features import eval_batches
from specdecode.training.trainer import STATE, evaluate, read_state

POSITION_OFFSET = {"medusa": 1, "mtp": 1, "draft": 1}  # acc_k -> draft position k - offset


def trained_state(run_dir, method: str) -> dict:
    st = read_state(run_dir, method)
    if st is None:
        path = Path(run_dir) / STATE
        raise SpecDecodeError(f"{path} does not exist: give the --out directory of a `specdecode train` run")
    return st


@torch.no_grad()
def offline_accuracy(task, target, seqs: list, tokens_per_batch: int, max_batches: int) -> dict[int, float]:
    sums: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    offset = POSITION_OFFSET.get(task.method, 0)
    for batch, feats in eval_batches(task, target, seqs, tokens_per_batch, max_batches):
        _, logs = task.module(batch, feats)
        for key, value in logs.items():
            if key.startswith("acc_"):
                pos = int(key[4:]) - offset
                sums[pos] += float(value)
                counts[pos] += 1
    return {j: sums[j] / counts[j] for j in sorted(sums)}


def compare(task, target, heldout_seqs: list, prompts: list[list[int]], cfg, max_batches: int = 32) -> dict:
    offline = offline_accuracy(task, target, heldout_seqs, cfg.tokens_per_batch, max_batches)
    served = evaluate(task.make_drafter(), target, prompts, cfg.eval_num_draft, cfg.eval_max_new_tokens)
    rows = []
    for j, acc in offline.items():
        s = served["acceptance"][j] if j < len(served["acceptance"]) else None
        gap = None if s is None else round(100 * (acc - s), 1)
        rows.append(
            {
                "position": j,
                "offline": round(acc, 4),
                "served": None if s is None else round(s, 4),
                "gap": gap,
            }
        )
    return {
        "rows": rows,
        "served_tau": round(served["tau"], 3),
        "sequences": len(heldout_seqs),
        "prompts": len(prompts),
    }


def format_rows(res: dict) -> str:
    lines = ["| draft position | offline accuracy | served acceptance | gap (points) |", "|---|---|---|---|"]
    for r in res["rows"]:
        served = "-" if r["served"] is None else f"{r['served']:.3f}"
        gap = "-" if r["gap"] is None else f"{r['gap']:+.1f}"
        lines.append(f"| {r['position']} | {r['offline']:.3f} | {served} | {gap} |")
    lines.append(
        f"served tau {res['served_tau']} over {res['prompts']} held-out prompts; offline over "
        f"{res['sequences']} held-out regenerated sequences"
    )
    return "\n".join(lines)
