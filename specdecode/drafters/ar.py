"""The `ar` baseline: proposes nothing, so every step verifies one token (K = 0).

Contract: running it through the same loop as every other method gives the baseline that
speed-ups are measured against (same engine, same prompts, same dtype).
"""

from specdecode.drafters.base import Drafter


class ARDrafter(Drafter):
    name = "ar"
