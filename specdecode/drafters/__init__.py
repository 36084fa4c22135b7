"""The drafter registry: every method family's `Method` record, in one place.

Contract: `REGISTRY` lists one `drafter.Method` per drafter family (a package or module; ngram's
module holds two: prompt lookup, and the table-backed `ngram-table` with its own checkpoint
kind), in the order the CLI shows them; `method_record(name)` finds the record that serves a
`--method` name (refusing unknown names with the valid ones); `build_drafter(method, target,
drafter_spec, ...)` returns a ready `Drafter` or raises `SpecDecodeError` saying what to pass.
`METHODS`, `DEFAULT_NUM_DRAFT` and `DRAFTER_OPTIONS` are views of the records for the CLI and
the API. Nothing method-specific lives outside the drafter packages.
"""

from __future__ import annotations

from specdecode.drafter import Drafter, DraftRow, Method, Proposal
from specdecode.drafters import ar, dflash, draft_model, dspark, eagle, medusa, mtp, ngram
from specdecode.drafters.checkpoint import checkpoint_path
from specdecode.errors import SpecDecodeError

__all__ = [
    "DEFAULT_NUM_DRAFT",
    "DRAFTER_OPTIONS",
    "METHODS",
    "REGISTRY",
    "DraftRow",
    "Drafter",
    "Method",
    "Proposal",
    "build_drafter",
    "method_record",
]

REGISTRY: tuple[Method, ...] = (
    ar.METHOD,
    ngram.METHOD,
    ngram.TABLE_METHOD,
    draft_model.METHOD,
    medusa.METHOD,
    mtp.METHOD,
    eagle.METHOD,
    dflash.METHOD,
    dspark.METHOD,
)
_BY_VARIANT = {v: m for m in REGISTRY for v in m.variants}
METHODS = tuple(_BY_VARIANT)
DEFAULT_NUM_DRAFT = {v: k for m in REGISTRY for v, k in m.variants.items()}
# Options only some drafters take (from the CLI): option -> the methods that accept it.
DRAFTER_OPTIONS = {
    opt: tuple(v for m in REGISTRY if opt in m.options for v in m.variants)
    for opt in sorted({o for m in REGISTRY for o in m.options})
}


def method_record(name: str) -> Method:
    if name not in _BY_VARIANT:
        raise SpecDecodeError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return _BY_VARIANT[name]


def build_drafter(
    method: str,
    target,
    drafter_spec: str | None = None,
    dtype="auto",
    device=None,
    options: dict | None = None,
) -> Drafter:
    record = method_record(method)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    for k in options:
        if k not in record.options:
            flag = "--" + k.replace("_", "-")
            raise SpecDecodeError(f"{flag} is only used by --method {', '.join(DRAFTER_OPTIONS.get(k, ()))}")
    if record.needs_drafter is False and drafter_spec is not None:
        raise SpecDecodeError(f"--drafter is not used by --method {method}")
    if record.checkpoint is not None:  # --drafter DIR, else the drafter shipped for this target
        drafter_spec = checkpoint_path(record.checkpoint, target, drafter_spec)
    return record.load(method, target, drafter_spec, dtype=dtype, device=device, **options)
