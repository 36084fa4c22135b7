"""Python API: as short as the CLI.

    import specdecode
    sd = specdecode.load("smollm2-135m", method="ngram")
    result = sd.generate("Write a haiku about caches.", max_new_tokens=64)
    for text in sd.stream("Explain speculative decoding.", chat=True):
        print(text, end="")

Contract: `load(target, method, drafter, **options)` is `build(LoadOptions(...))`: the options and
their defaults are `specdecode.build.LoadOptions` (num_draft_tokens, policy, dtype, device,
max_batch, verify_mode, max_model_len, drafter_options). It returns a `SpecDecode` whose
`generate` / `stream` take text, chat messages, or a list of prompts. Output is exactly the
target's distribution (greedy at temperature 0).
"""

from __future__ import annotations

from specdecode.build import DEFAULT_TARGET, LoadOptions, SpecDecode, build

__all__ = ["LoadOptions", "SpecDecode", "load"]


def load(target=DEFAULT_TARGET, method: str = "ar", drafter: str | None = None, **options) -> SpecDecode:
    """Resolve the target and the drafter and return a ready `SpecDecode` (see `LoadOptions`)."""
    return build(LoadOptions(target, method, drafter, **options))
