"""`FixedK`: every request drafts K tokens every step (the papers' setting)."""

from __future__ import annotations

from specdecode.errors import SpecDecodeError
from specdecode.policy.base import DraftPolicy, PolicyState


class FixedK(DraftPolicy):
    def __init__(self, k: int):
        if k < 0:
            raise SpecDecodeError(f"--num-draft-tokens must be >= 0, got {k}")
        self.k_max = k

    def choose(self, states: list[PolicyState]) -> list[int]:
        return [self.k_max] * len(states)

    def observe(self, state: PolicyState, num_draft: int, num_accepted: int) -> None:
        pass
