"""Draft-length policies: how many tokens each request drafts this step.

Contract: `choose(states) -> list[int]` gives K per request; `observe(state, num_draft,
num_accepted)` updates per-request statistics after verification. Decisions depend only on
the request's own history and fixed constants, never on wall-clock timings, so a seeded run
is reproducible and a request decodes the same alone or in a batch.

- `FixedK`: always K.
- `AdaptiveK`: estimates the request's per-token acceptance rate alpha (decayed counts) and
  picks the K in [0, K_max] that maximises the expected speed-up
      E[tau](K) / (verify_cost[K] + K * draft_cost),
  with E[tau](K) = (1 - alpha^(K+1)) / (1 - alpha) (METHODS.md section 2), verify_cost[K] the
  cost of a target forward of K+1 tokens relative to one token (measured: `profile.py`), and
  draft_cost the cost of one draft token relative to a target step. When acceptance is poor
  it falls to K = 0 (plain decoding) and probes with K = 1 now and then (backing off) so it can
  recover when the text becomes predictable again. Where the measured costs say that even
  perfect acceptance would not pay, it never drafts.
- `scheduled` / `scheduled-production` (`specdecode.engine.scheduler.ConfidenceScheduler`): the
  DSpark prefix scheduler over the whole batch, from measured step costs SPS(B) and per-position
  survival (the drafter's confidences, else running acceptance statistics kept in
  `PolicyState`). Its K for a request depends on the load, so unlike the two above it is not a
  per-request decision (see decode.py for what that means for seeded sampling).

Before each `choose` the loop sets `PolicyState.context_len` (tokens in the request) and
`PolicyState.room` (drafts the request can still use), which batch-level policies read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.errors import SpecDecodeError


@dataclass
class PolicyState:
    """Per-request statistics a policy keeps (owned by the request)."""

    accepted: float = 1.0  # decayed count of accepted drafts (optimistic prior)
    tried: float = 1.5  # decayed count of drafts that were checked (up to the first rejection)
    steps_at_zero: int = 0
    probe_every: int = 0  # current probing interval while at K = 0 (backs off after failed probes)
    # Set by the loop before each choose(): what batch-level schedulers read.
    context_len: int = 0  # tokens in the request (prompt + output so far)
    room: int | None = None  # most drafts the request can still use (None = no limit)
    last_k: int = 0  # K a batch-level policy asked for in the last step
    # Decayed per-position counts (index k-1 = draft position k): checked / accepted drafts.
    pos_reached: list[float] = field(default_factory=list)
    pos_accepted: list[float] = field(default_factory=list)
    # Drafters with confidences: decayed mean of the reported prefix survival per position.
    conf_survival: list[float | None] = field(default_factory=list)


def expected_tau(alpha: float, k: int) -> float:
    """Expected tokens per step with k drafts and i.i.d. per-token acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class FixedK:
    def __init__(self, k: int):
        if k < 0:
            raise SpecDecodeError(f"--num-draft-tokens must be >= 0, got {k}")
        self.k_max = k

    def choose(self, states: list[PolicyState]) -> list[int]:
        return [self.k_max] * len(states)

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        pass


class AdaptiveK:
    MIN_GAIN = 0.05  # drafting must promise at least a 5 % speed-up at perfect acceptance

    def __init__(
        self,
        k_max: int,
        draft_cost: float = 0.0,
        verify_cost: float | Sequence[float] = 0.03,
        decay: float = 0.9,
        probe_every: int = 8,
    ):
        """verify_cost: relative cost per extra verified token, or the measured curve
        [t(1), t(2), ..., t(k_max + 1)] / t(1) of target forwards of n tokens."""
        if k_max < 0:
            raise SpecDecodeError(f"--num-draft-tokens must be >= 0, got {k_max}")
        if isinstance(verify_cost, (int, float)):
            self.verify_cost = [1.0 + verify_cost * k for k in range(k_max + 1)]
        else:
            self.verify_cost = [float(c) for c in verify_cost]
            if len(self.verify_cost) < k_max + 1:
                raise ValueError(
                    f"verify_cost needs {k_max + 1} entries (n = 1..K+1), got {len(self.verify_cost)}"
                )
        self.k_max, self.draft_cost = k_max, draft_cost
        self.decay, self.probe_every = decay, probe_every
        # If even perfect acceptance cannot pay for drafting on this machine, never draft (and
        # never probe): speculation is then exactly plain decoding plus nothing.
        best_case = max((k + 1) / (self.verify_cost[k] + k * draft_cost) for k in range(k_max + 1))
        self.enabled = best_case > 1.0 + self.MIN_GAIN

    def best_k(self, alpha: float) -> int:
        speedups = [
            expected_tau(alpha, k) / (self.verify_cost[k] + k * self.draft_cost)
            for k in range(self.k_max + 1)
        ]
        return max(range(self.k_max + 1), key=lambda k: (speedups[k], -k))

    def choose(self, states: list[PolicyState]) -> list[int]:
        if not self.enabled:
            return [0] * len(states)
        ks = []
        for st in states:
            k = self.best_k(st.accepted / max(st.tried, 1e-6))
            if k == 0 and self.k_max > 0:
                # Probe with one draft now and then; each probe that does not lift the estimate
                # doubles the interval (up to 64 steps), so a hopeless request costs ~nothing.
                st.probe_every = st.probe_every or self.probe_every
                st.steps_at_zero += 1
                if st.steps_at_zero >= st.probe_every:
                    k, st.steps_at_zero = 1, 0
                    st.probe_every = min(2 * st.probe_every, 64)
            else:
                st.steps_at_zero, st.probe_every = 0, 0
            ks.append(k)
        return ks

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        tried = min(num_accepted + 1, num_draft)
        state.accepted = self.decay * state.accepted + num_accepted
        state.tried = self.decay * state.tried + tried


POLICIES = ("fixed", "adaptive", "scheduled", "scheduled-production")


def make_policy(
    name: str,
    k: int,
    draft_cost: float = 0.0,
    verify_cost: float | Sequence[float] = 0.03,
    step_cost=None,
    online: bool = False,
):
    """step_cost: a `StepCostModel` (measured SPS profile), needed by the scheduled policies;
    online: the scheduled policies correct that profile and the drafting cost from measured steps."""
    if name == "fixed":
        return FixedK(k)
    if name == "adaptive":
        return AdaptiveK(k, draft_cost=draft_cost, verify_cost=verify_cost)
    if name in ("scheduled", "scheduled-production"):
        from specdecode.engine.scheduler import ConfidenceScheduler

        if step_cost is None:
            raise SpecDecodeError(f"the {name!r} policy needs a measured step-cost profile (SPS)")
        variant = "production" if name == "scheduled-production" else "exact"
        return ConfidenceScheduler(k, step_cost, draft_cost=draft_cost, variant=variant, online=online)
    raise SpecDecodeError(f"unknown draft-length policy {name!r}; choose one of: {', '.join(POLICIES)}")
