"""Draft-length policies: fixed, adaptive and scheduled, behind one interface (`base.py`).

Contract: `make_policy(name, k, ...)` builds the policy named by `--policy` (one of `POLICIES`);
the step-cost measurements the adaptive and scheduled policies read live in `profile.py`
(`step_costs`, `batch_step_costs`) and `costs.py` (`StepCostModel`).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.errors import SpecDecodeError
from specdecode.policy.adaptive import AdaptiveK
from specdecode.policy.base import DraftPolicy, PolicyState, expected_tau
from specdecode.policy.costs import StepCostModel
from specdecode.policy.fixed import FixedK
from specdecode.policy.profile import (
    batch_step_costs,
    draft_round_costs,
    measure_step_cost_curves,
    measure_step_costs,
    step_cost_curves,
    step_costs,
)
from specdecode.policy.scheduled import ScheduledK

__all__ = [
    "POLICIES",
    "AdaptiveK",
    "ScheduledK",
    "DraftPolicy",
    "FixedK",
    "PolicyState",
    "StepCostModel",
    "batch_step_costs",
    "draft_round_costs",
    "expected_tau",
    "make_policy",
    "measure_step_cost_curves",
    "measure_step_costs",
    "step_cost_curves",
    "step_costs",
]
POLICIES = ("fixed", "adaptive", "scheduled", "scheduled-production")


def make_policy(
    name: str,
    k: int,
    draft_cost: float = 0.0,
    verify_cost: float | Sequence[float] = 0.03,
    step_cost=None,
    online: bool = False,
    draft_fixed: float = 0.0,
    draft_curve: Sequence[float] | None = None,
    verify_curves: dict[int, Sequence[float]] | None = None,
    sampled_extra: Sequence[float] | None = None,
    sampled_k_max: int | None = None,
) -> DraftPolicy:
    """step_cost: a `StepCostModel` (measured SPS profile), needed by the scheduled policies;
    online: the scheduled policies correct that profile and the drafting cost from measured steps;
    draft_fixed: a drafting round's cost beyond its per-token cost; draft_curve: a round's
    measured cost for K = 1..k, which the adaptive policy reads instead of the line where given;
    verify_curves: {context: seconds of forwards of 1..k+1 tokens}, read by the adaptive policy at
    each request's context; sampled_extra: what a sampled step with K = 0..k drafts costs beyond a
    greedy one (beyond plain sampled decoding), in target steps, added for requests at T > 0;
    sampled_k_max: the most drafts the drafter gives a request at T > 0 (an EAGLE-2 tree's
    sampled chain), the adaptive policy's bound for such requests."""
    if name == "fixed":
        return FixedK(k)
    if name == "adaptive":
        return AdaptiveK(
            k,
            draft_cost=draft_cost,
            verify_cost=verify_cost,
            draft_fixed=draft_fixed,
            draft_curve=draft_curve,
            verify_curves=verify_curves,
            sampled_extra=sampled_extra,
            sampled_k_max=sampled_k_max,
        )
    if name in ("scheduled", "scheduled-production"):
        if step_cost is None:
            raise SpecDecodeError(f"the {name!r} policy needs a measured step-cost profile (SPS)")
        variant = "production" if name == "scheduled-production" else "exact"
        return ScheduledK(k, step_cost, draft_cost=draft_cost, variant=variant, online=online)
    raise SpecDecodeError(f"unknown draft-length policy {name!r}; choose one of: {', '.join(POLICIES)}")
