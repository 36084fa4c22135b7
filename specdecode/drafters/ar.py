"""The `ar` baseline: proposes nothing, so every step verifies one token (K = 0).

Contract: running it through the same loop as every other method gives the baseline that
speed-ups are measured against (same engine, same prompts, same dtype).
"""

from __future__ import annotations

from specdecode.drafter import Drafter, Method


class ARDrafter(Drafter):
    name = "ar"


METHOD = Method(
    name="ar",
    variants={"ar": 0},
    load=lambda variant, target, spec, **kw: ARDrafter(),
    needs_drafter=False,
    summary="plain autoregressive decoding through the same loop (the baseline)",
)
