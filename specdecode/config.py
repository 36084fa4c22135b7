"""Typed, validated configuration records.

Contract: `SamplingParams` is validated at construction; an impossible value raises
`SpecDecodeError` naming the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The same processing is applied to target and drafter.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: 0 disables; otherwise keep the k most likely tokens.
    top_p: 1.0 disables; otherwise keep the smallest set whose mass reaches top_p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise SpecDecodeError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecDecodeError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise SpecDecodeError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
