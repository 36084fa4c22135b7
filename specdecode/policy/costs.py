"""The step-cost model SPS(B) the scheduled policies read.

Contract: `StepCostModel.time(rows, block, context)` predicts the seconds of one decode step: a
target forward of `rows` requests x `block` tokens each (the loop pads ragged blocks, so the
longest block sets the work) over `context` committed tokens, plus drafting `block - 1` tokens
at `draft_cost` target steps each. `sps(rows, block, context)` = 1 / time: SPS(B) for
B = rows x block tokens. `StepCostModel.measured(...)` reads the profile of `profile.py`
(measured once per machine and cached); `flat` / `linear` are synthetic models for tests.
`fill_gaps` (and `interp`, from `profile.py`, which times drafting rounds with it) are the
piecewise-linear helpers both this model and the scheduler use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.policy.profile import batch_step_costs, interp

PROFILE_CONTEXTS = (256, 1024)


def fill_gaps(values: Sequence[float | None], default: float, first: float | None = None) -> list[float]:
    """Measured values with the gaps filled linearly between measured neighbours (constant past
    the ends; `first` pins index 0); all `default` when nothing is measured."""
    vals = list(values)
    if first is not None:
        vals[0] = first
    known = [i for i, v in enumerate(vals) if v is not None]
    if not known:
        return [default] * len(vals)
    ys = [vals[i] for i in known]
    return [interp(known, ys, min(max(i, known[0]), known[-1])) for i in range(len(vals))]


@dataclass
class StepCostModel:
    rows: list[int]  # measured batch sizes, ascending
    blocks: list[int]  # measured tokens per request, ascending (1 first)
    contexts: list[int]  # measured committed lengths, ascending
    times: list[list[list[float]]]  # [context][rows][block] seconds
    draft_cost: float = 0.0  # one drafted position, in target steps of the same batch (block 1)

    def target_time(self, rows: int, block: int, context: int) -> float:
        per_ctx = []
        for grid in self.times:
            by_rows = [interp(self.blocks, line, block) for line in grid]
            per_ctx.append(interp(self.rows, by_rows, rows))
        return interp(self.contexts, per_ctx, context) if len(per_ctx) > 1 else per_ctx[0]

    def time(self, rows: int, block: int, context: int) -> float:
        t = self.target_time(rows, block, context)
        if block > 1 and self.draft_cost > 0:
            t += (block - 1) * self.draft_cost * self.target_time(rows, 1, context)
        return t

    def sps(self, rows: int, block: int, context: int) -> float:
        """Steps per second at B = rows x block tokens."""
        return 1.0 / self.time(rows, block, context)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def measured(cls, target, max_rows: int, max_block: int, max_context: int, draft_cost: float = 0.0):
        """The cached profile of `target` (a LoadedModel) on this machine (profile.py)."""
        cap = target.model.info.max_slots or max_rows
        rows = sorted(
            {r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r < min(max_rows, cap)} | {min(max_rows, cap)}
        )
        blocks = sorted({b for b in (1, 2, 3, 5, 8, 12, 16) if b < max_block} | {max_block})
        hi = max(16, max_context - max_block - 1)
        contexts = sorted({min(c, hi) for c in PROFILE_CONTEXTS})
        times = batch_step_costs(target.model, target.fingerprint, rows, blocks, contexts)
        return cls(rows, blocks, contexts, times, draft_cost)

    @classmethod
    def linear(cls, per_token: float, fixed: float = 0.0, draft_cost: float = 0.0, max_rows: int = 64):
        """time = fixed + per_token x rows x block: verification is never cheap (compute-bound)."""
        rows, blocks = [1, max_rows], [1, 16]
        grid = [[fixed + per_token * r * b for b in blocks] for r in rows]
        return cls(rows, blocks, [0], [grid], draft_cost)

    @classmethod
    def flat(cls, step: float = 1.0, per_token: float = 0.0, draft_cost: float = 0.0, max_rows: int = 64):
        """time = step + per_token x rows x block: verifying extra tokens is (nearly) free."""
        return cls.linear(per_token, fixed=step, draft_cost=draft_cost, max_rows=max_rows)
