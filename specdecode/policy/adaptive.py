"""`AdaptiveK`: per-request K from the request's own acceptance rate and the measured costs.

Contract: it estimates the request's per-token acceptance rate alpha (decayed counts) and picks
the K in [0, K_max] that maximises the expected speed-up
    E[tau](K) / (verify_cost[K] + [K > 0] * draft_fixed + K * draft_cost),
(or verify_cost[K] + draft_curve[K] where a round's cost was measured as a curve over K),
with E[tau](K) = (1 - alpha^(K+1)) / (1 - alpha) (docs/methods.md, "Speculative sampling"),
verify_cost[K] the cost of a target forward of K+1 tokens relative to one token (measured:
`profile.py`), draft_cost the cost of one draft token and draft_fixed what a drafting round
costs beyond its tokens (a block drafter's one forward, catching up on committed context),
both relative to a target step (measured once per machine for learned drafters: `build.py`). When
acceptance is poor it falls to K = 0 (plain decoding) and probes with K = 1 now and then (backing
off) so it can recover when the text becomes predictable again. Where the measured costs say that
even perfect acceptance would not pay, it never drafts. Decisions depend only on the request's
own history and fixed constants, never on wall-clock timings, so a seeded run is reproducible
and a request decodes the same alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.errors import SpecDecodeError
from specdecode.policy.base import DraftPolicy, PolicyState, expected_tau


class AdaptiveK(DraftPolicy):
    MIN_GAIN = 0.05  # drafting must promise at least a 5 % speed-up at perfect acceptance
    MARGIN = 0.05  # a round must promise 5 % over plain decoding at the estimated acceptance

    def __init__(
        self,
        k_max: int,
        draft_cost: float = 0.0,
        verify_cost: float | Sequence[float] = 0.03,
        decay: float = 0.9,
        probe_every: int = 8,
        draft_fixed: float = 0.0,
        draft_curve: Sequence[float] | None = None,
    ):
        """verify_cost: relative cost per extra verified token, or the measured curve
        [t(1), t(2), ..., t(k_max + 1)] / t(1) of target forwards of n tokens; draft_curve:
        a round's measured cost for K = 1..k_max (in target steps), read instead of
        draft_fixed + K * draft_cost (a tree's cost is not a line in K)."""
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
        self.k_max, self.draft_cost, self.draft_fixed = k_max, draft_cost, draft_fixed
        self.draft_curve = None if draft_curve is None else [float(c) for c in draft_curve]
        if self.draft_curve is not None and len(self.draft_curve) < k_max:
            raise ValueError(f"draft_curve needs {k_max} entries (K = 1..K_max), got {len(self.draft_curve)}")
        self.decay, self.probe_every = decay, probe_every
        # If even perfect acceptance cannot pay for drafting on this machine, never draft (and
        # never probe): speculation is then exactly plain decoding plus nothing.
        best_case = max((k + 1) / self.round_cost(k) for k in range(k_max + 1))
        self.enabled = best_case > 1.0 + self.MIN_GAIN

    def round_cost(self, k: int) -> float:
        """A step that drafts k tokens, in target one-token steps."""
        if k == 0:
            return self.verify_cost[0]
        if self.draft_curve is not None:
            return self.verify_cost[k] + self.draft_curve[k - 1]
        return self.verify_cost[k] + self.draft_fixed + k * self.draft_cost

    def best_k(self, alpha: float) -> int:
        speedups = [expected_tau(alpha, k) / self.round_cost(k) for k in range(self.k_max + 1)]
        k = max(range(self.k_max + 1), key=lambda k: (speedups[k], -k))
        return k if speedups[k] >= 1.0 + self.MARGIN else 0

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
