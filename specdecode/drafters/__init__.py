"""Drafter registry: method name -> drafter construction.

Contract: `build_drafter(method, target, drafter_spec, ...)` returns a ready `Drafter`, or raises
`SpecDecodeError` naming the valid methods / what drafter model to pass. Nothing
method-specific lives outside `specdecode/drafters/`.
"""

from __future__ import annotations

from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.base import Drafter, DraftRow, Proposal
from specdecode.drafters.ngram import NgramDrafter
from specdecode.errors import SpecDecodeError

METHODS = ("ar", "ngram", "draft", "medusa", "medusa-tree", "mtp", "eagle", "eagle-tree", "dflash", "dspark")
DEFAULT_NUM_DRAFT = {
    "ar": 0,
    "ngram": 6,
    "draft": 5,
    "medusa": 4,
    "medusa-tree": 16,
    "mtp": 3,
    "eagle": 4,
    "eagle-tree": 16,
    "dflash": 7,
    "dspark": 7,
}
# Learned drafters: method -> (checkpoint method, loader); the checkpoint comes from --drafter DIR
# or, for a target that has one, the drafter shipped in specdecode/data/drafters/.
LEARNED = {
    "medusa": "medusa",
    "medusa-tree": "medusa",
    "mtp": "mtp",
    "eagle": "eagle",
    "eagle-tree": "eagle",
    "dflash": "dflash",
    "dspark": "dspark",
}
# Options only some drafters take (from the CLI): option -> the methods that accept it.
DRAFTER_OPTIONS = {"confidence_threshold": ("dspark",), "threshold_on": ("dspark",)}
# Default drafter model per target alias for the classic draft-model method.
DEFAULT_DRAFT_MODEL = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}

__all__ = ["METHODS", "DraftRow", "Drafter", "Proposal", "build_drafter"]


def build_drafter(
    method: str,
    target,
    drafter_spec: str | None = None,
    dtype="auto",
    device=None,
    options: dict | None = None,
) -> Drafter:
    if method not in METHODS:
        raise SpecDecodeError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    options = {k: v for k, v in (options or {}).items() if v is not None}
    for k in options:
        if method not in DRAFTER_OPTIONS.get(k, ()):
            flag = "--" + k.replace("_", "-")
            raise SpecDecodeError(f"{flag} is only used by --method {', '.join(DRAFTER_OPTIONS.get(k, ()))}")
    if method in ("ar", "ngram") and drafter_spec is not None:
        raise SpecDecodeError(f"--drafter is not used by --method {method}")
    if method == "ar":
        return ARDrafter()
    if method == "ngram":
        return NgramDrafter()
    if method in LEARNED:
        return _learned(method, target, drafter_spec, options)
    from specdecode.drafters.checkpoint import is_checkpoint, shipped_drafter
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.models.loader import load_model, same_tokenizer

    spec = drafter_spec or DEFAULT_DRAFT_MODEL.get(target.name) or shipped_drafter("draft", target)
    if spec is not None and is_checkpoint(spec):  # a draft model distilled by `specdecode train draft`
        from specdecode.drafters.distill import load_distilled

        return load_distilled(spec, target)
    if spec is None:
        raise SpecDecodeError(
            f"--method draft needs a drafter model for target {target.name!r}: pass --drafter MODEL "
            "(an alias, a Hugging Face directory or hub id of a smaller model with the same tokenizer)"
        )
    small = load_model(spec, dtype=dtype, device=device)
    if not same_tokenizer(small.tokenizer, target.tokenizer):
        raise SpecDecodeError(
            f"drafter {spec!r} uses a different tokenizer than target {target.name!r}; "
            "a draft model must share the target's tokenizer (same vocabulary and special tokens)"
        )
    # cost_per_token is measured by the adaptive policy's profile (api.load), keyed by this
    # fingerprint; FixedK ignores it.
    return DraftModelDrafter(
        small.model, target.vocab_size, target.model.info.vocab_size, fingerprint=small.fingerprint
    )


def _learned(method: str, target, drafter_spec: str | None, options: dict) -> Drafter:
    from specdecode.drafters.checkpoint import shipped_drafter

    kind = LEARNED[method]
    path = drafter_spec or shipped_drafter(kind, target)
    if path is None:
        raise SpecDecodeError(
            f"no {kind} drafter ships for target {target.name!r}; train one with "
            f"`specdecode train {kind} --target {target.name} --data DIR --out DIR` and pass --drafter DIR"
        )
    if kind == "eagle":
        from specdecode.drafters.eagle import TreeSpec, load_eagle

        return load_eagle(path, target, tree=TreeSpec() if method == "eagle-tree" else None)
    if kind == "medusa":
        from specdecode.drafters.medusa import load_medusa

        return load_medusa(path, target, tree=method == "medusa-tree")
    if kind == "mtp":
        from specdecode.drafters.mtp import load_mtp

        return load_mtp(path, target)
    if kind == "dflash":
        from specdecode.drafters.dflash import load_dflash

        return load_dflash(path, target)
    if kind == "dspark":
        from specdecode.drafters.dspark import load_dspark

        return load_dspark(path, target, **options)
    raise AssertionError(kind)
