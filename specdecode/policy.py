"""Draft-length policies: how many tokens each request drafts this step.

Contract: `choose(states) -> list[int]` gives K per request; `observe(state, num_draft,
num_accepted)` updates per-request statistics after verification. Decisions depend only on
the request's own history and fixed constants, never on wall-clock timings, so a seeded run
is reproducible and a request decodes the same alone or in a batch.

- `FixedK`: always K.
- `AdaptiveK`: estimates the request's per-token acceptance rate alpha (decayed counts) and
  picks the K in [0, K_max] that maximises the expected speed-up
      E[tau](K) / (1 + K * (drafter cost per token + verify cost per extra token)),
  with E[tau](K) = (1 - alpha^(K+1)) / (1 - alpha) (METHODS.md section 2). When acceptance is
  poor it falls to K = 0 (plain decoding) and probes with K = 1 every `probe_every` steps so it
  can recover when the text becomes predictable again.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass
class PolicyState:
    """Per-request statistics a policy keeps (owned by the request)."""

    accepted: float = 1.0  # decayed count of accepted drafts (optimistic prior)
    tried: float = 1.5  # decayed count of drafts that were checked (up to the first rejection)
    steps_at_zero: int = 0


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
    def __init__(
        self,
        k_max: int,
        draft_cost: float = 0.0,
        verify_cost: float = 0.03,
        decay: float = 0.9,
        probe_every: int = 8,
    ):
        if k_max < 0:
            raise SpecDecodeError(f"--num-draft-tokens must be >= 0, got {k_max}")
        self.k_max, self.draft_cost, self.verify_cost = k_max, draft_cost, verify_cost
        self.decay, self.probe_every = decay, probe_every

    def best_k(self, alpha: float) -> int:
        per_token = self.draft_cost + self.verify_cost
        speedups = [expected_tau(alpha, k) / (1.0 + k * per_token) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=lambda k: (speedups[k], -k))

    def choose(self, states: list[PolicyState]) -> list[int]:
        ks = []
        for st in states:
            k = self.best_k(st.accepted / max(st.tried, 1e-6))
            if k == 0 and self.k_max > 0:
                st.steps_at_zero += 1
                if st.steps_at_zero % self.probe_every == 0:
                    k = 1
            else:
                st.steps_at_zero = 0
            ks.append(k)
        return ks

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        tried = min(num_accepted + 1, num_draft)
        state.accepted = self.decay * state.accepted + num_accepted
        state.tried = self.decay * state.tried + tried


def make_policy(name: str, k: int, draft_cost: float = 0.0):
    if name == "fixed":
        return FixedK(k)
    if name == "adaptive":
        return AdaptiveK(k, draft_cost=draft_cost)
    raise SpecDecodeError(f"unknown draft-length policy {name!r}; choose one of: fixed, adaptive")
