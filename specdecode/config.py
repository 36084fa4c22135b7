"""Typed, validated configuration records.

Contract: `SamplingParams` is validated at construction; an impossible value raises
`SpecDecodeError` naming the field and the allowed range. Validation and processing agree on one
rule so that no accepted value can turn probabilities into NaN: a temperature below
`MIN_TEMPERATURE` is greedy (stored as 0.0), and a top_p below `MIN_TOP_P` (the smallest positive
fp32 value, the precision processing runs in) keeps only the most likely token (stored as
`MIN_TOP_P`; processing always keeps the top token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError

# Below this a temperature is greedy: logits / T would overflow fp32 (max 3.4e38) for T ~ 1e-38,
# and well before that every mass but the argmax's is below fp32's resolution anyway.
MIN_TEMPERATURE = 1e-5
# The smallest positive fp32 number: a smaller top_p rounds to 0 in fp32 processing.
MIN_TOP_P = 1.401298464324817e-45


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The same processing is applied to target and drafter.

    temperature: 0 means greedy (argmax); > 0 divides the logits; below MIN_TEMPERATURE it is
        greedy (stored as 0.0).
    top_k: 0 disables; otherwise keep the k most likely tokens.
    top_p: 1.0 disables; otherwise keep the smallest set whose mass reaches top_p (always at
        least the most likely token; values below MIN_TOP_P are stored as MIN_TOP_P).
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
        # One rule for validation and processing (see the module docstring); frozen, so set directly.
        if 0.0 < t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "temperature", float(self.temperature))
        if p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
