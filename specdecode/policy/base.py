"""The draft-length policy interface: how many tokens each request drafts this step.

Contract:
- `DraftPolicy.choose(states) -> list[int]` gives K per request; `observe(state, num_draft,
  num_accepted)` updates the request's statistics after verification. `k_max` bounds every K
  (the loop reserves cache rows for it).
- Drafters that report per-position confidences (`Drafter.provides_confidences`) are asked
  `bounds(states)` before drafting (default: `choose`), and the loop lets the policy shorten the
  drafted chains with `truncate(states, confidences, num_draft)` (default: keep them). A
  truncation may read only values known before each draft token was drawn, so it stays lossless.
- `observe_step(rows, block, context, drafted, draft_s, verify_s)` reports each step's measured
  times (default: ignored; the scheduled policies learn their costs from it).
- `PolicyState` is the per-request record a policy keeps (owned by the request). Before each
  `choose` the loop sets `context_len` (tokens in the request) and `room` (drafts the request can
  still use), which batch-level policies read; `sampled` (T > 0) is set once, at admission.
- `expected_tau(alpha, k)`: expected tokens per step with k drafts and i.i.d. acceptance alpha.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
    sampled: bool = False  # the request samples (T > 0): its rounds and verification cost more
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


class DraftPolicy:
    """Base class: K = 0 for everyone (plain decoding); every hook has a neutral default."""

    k_max: int = 0
    enabled: bool = True  # False: drafting cannot pay on this machine, so the policy never drafts

    def choose(self, states: list[PolicyState]) -> list[int]:
        return [0] * len(states)

    def bounds(self, states: list[PolicyState]) -> list[int]:
        """K per request before a drafter that reports confidences runs (default: `choose`)."""
        return self.choose(states)

    def truncate(self, states: list[PolicyState], confidences, num_draft: Sequence[int]) -> list[int]:
        """How many of each drafted chain to verify, given confidences [B, K] (default: all)."""
        return list(num_draft)

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        pass

    def observe_step(
        self, rows: int, block: int, context: int, drafted: int, draft_s: float, verify_s: float
    ) -> None:
        pass
