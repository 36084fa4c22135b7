"""Training prompt set for drafters: real offline sources, disjoint from every benchmark prompt.

Contract:
- Five deterministic offline sources (code, docs, math, instructions, chat; `training/sources.py`),
  mixed in fixed `SOURCE_SHARES`; `sources=` builds a set from some of them, their shares
  renormalised (the four older ones alone rebuild version 1's sets exactly).
- A record: `{"id": "<source>/<template>/<subject>", "source", "messages": [one user turn]}`
  (+ `"answer"`: int, math only). Ids are unique, and so are user texts after `normalize_text`.
- `build_prompt_set(num_prompts, heldout_fraction, seed, sources)` takes each source's quota (largest
  remainder) from its pool in sha256(seed, id) order, so a larger set with the same seed contains
  a smaller one, and interleaves the sources so that every prefix holds them in proportion. A
  record is held out when the hash of its normalised text is below `heldout_fraction`: it is on
  the same side in every set, whatever num_prompts or seed (a tiny set may hold out nothing).
- `check_disjoint(records)` raises if a user text equals a `benchmark_texts()` entry or contains a
  HumanEval prompt. The pools are filtered with the same test and every built set is checked.
- `write_prompt_set(out_dir, ...)` writes train.jsonl, heldout.jsonl and stats.json as temp files,
  then renames them (stats.json last; it holds both files' sha256). An identical set already there
  is left as it is; any other non-empty directory is refused unless `overwrite=True`.
- Docstrings and pydoc topics depend on the CPython minor version: stats name it, and their
  `fingerprint` identifies the exact prompts (of train, then heldout).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import sys
from fractions import Fraction
from pathlib import Path

from specdecode.datasets import DATASET_VERSION, benchmark_texts, load_prompt_set, normalize_text
from specdecode.errors import SpecDecodeError
from specdecode.training.sources import SOURCE_SHARES, SOURCES, hash64, user_texts

PROMPT_SET_VERSION = "2"  # bump whenever any prompt changes (2: the chat source)
MIN_PROMPTS = 10


# ---------------------------------------------------------------------------------------------
# Disjointness from the benchmark


@functools.cache
def _benchmark() -> tuple[frozenset[str], tuple[str, ...]]:
    """(normalised benchmark texts, normalised HumanEval prompts)."""
    humaneval = {normalize_text(r["prompt"]) for r in load_prompt_set("humaneval", progress=False)}
    return frozenset(benchmark_texts()), tuple(sorted(humaneval))


def _overlaps(text: str) -> bool:
    texts, humaneval = _benchmark()
    norm = normalize_text(text)
    return norm in texts or any(len(p) <= len(norm) and p in norm for p in humaneval)


def check_disjoint(records: list[dict]) -> None:
    """Raise SpecDecodeError listing the ids of records whose user text equals a benchmark text
    (`benchmark_texts()`) or contains a benchmark HumanEval prompt."""
    bad = [str(r.get("id", f"#{i}")) for i, r in enumerate(records) if any(map(_overlaps, user_texts(r)))]
    if bad:
        more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise SpecDecodeError(
            f"{len(bad)} training prompt(s) overlap the benchmark prompts (dataset version "
            f"{DATASET_VERSION}): {', '.join(bad[:20])}{more}. Remove them from the training set."
        )


# ---------------------------------------------------------------------------------------------
# Public API


@functools.cache
def _pools() -> dict[str, tuple[dict, ...]]:
    """Source -> its records, without benchmark overlaps and without texts seen before."""
    seen, pools = set(), {}
    for source, build in SOURCES.items():
        pool = []
        for record in build():
            key = tuple(map(normalize_text, user_texts(record)))
            if key not in seen and not any(map(_overlaps, user_texts(record))):
                seen.add(key)
                pool.append(record)
        pools[source] = tuple(pool)
    return pools


def shares(sources=None) -> dict[str, Fraction]:
    """The mix of `sources` (None: all): their SOURCE_SHARES, renormalised to sum to 1."""
    names = tuple(SOURCE_SHARES) if sources is None else tuple(sources)
    unknown = [s for s in names if s not in SOURCE_SHARES]
    if unknown or not names or len(set(names)) != len(names):
        raise SpecDecodeError(
            f"sources must be distinct names from {', '.join(SOURCE_SHARES)}, "
            f"got {', '.join(names) or 'none'}"
        )
    total = sum(Fraction(str(SOURCE_SHARES[s])) for s in names)
    return {s: Fraction(str(share)) / total for s, share in SOURCE_SHARES.items() if s in names}


def _quotas(num_prompts: int, mix: dict[str, Fraction]) -> dict[str, int]:
    """Largest-remainder split of num_prompts over the mix (ties: source order)."""
    exact = {s: share * num_prompts for s, share in mix.items()}
    quotas = {s: int(q) for s, q in exact.items()}
    by_remainder = sorted(exact, key=lambda s: quotas[s] - exact[s])  # stable: source order on ties
    for s in by_remainder[: num_prompts - sum(quotas.values())]:
        quotas[s] += 1
    return quotas


@functools.cache
def max_prompts(sources: tuple[str, ...] | None = None) -> int:
    """The largest set the offline sources (None: all) supply in their mix."""
    pools, mix = _pools(), shares(sources)
    n = int(min(len(pools[s]) / share for s, share in mix.items())) + 1
    while any(q > len(pools[s]) for s, q in _quotas(n, mix).items()):
        n -= 1
    return n


def fingerprint(records: list[dict]) -> str:
    """Short sha256 of the records' ids and messages."""
    blob = json.dumps([[r["id"], r["messages"]] for r in records], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _is_heldout(record: dict, heldout_fraction: float) -> bool:
    return hash64("heldout", *map(normalize_text, user_texts(record))) < heldout_fraction * 2**64


def _check_params(num_prompts, heldout_fraction, seed, sources) -> dict[str, Fraction]:
    """Refuses bad parameters; returns the mix of `sources`."""
    mix = shares(sources)
    most = max_prompts(sources)
    if type(num_prompts) is not int or not MIN_PROMPTS <= num_prompts <= most:
        available = ", ".join(f"{s} {len(p)}" for s, p in _pools().items() if s in mix)
        in_mix = ", ".join(f"{s} {float(share):.3g}" for s, share in mix.items())
        raise SpecDecodeError(
            f"num_prompts must be an integer from {MIN_PROMPTS} to {most} (the maximum the offline "
            f"sources supply in the mix {in_mix}; distinct prompts: {available}), got {num_prompts!r}"
        )
    if type(heldout_fraction) not in (int, float) or not 0 < heldout_fraction <= 0.5:
        raise SpecDecodeError(f"heldout_fraction must be a number in (0, 0.5], got {heldout_fraction!r}")
    if type(seed) is not int:
        raise SpecDecodeError(f"seed must be an integer, got {seed!r}")
    return mix


def build_prompt_set(
    num_prompts: int = 4000, heldout_fraction: float = 0.05, seed: int = 0, sources=None
) -> dict:
    """{"train": [...], "heldout": [...], "stats": {...}}: num_prompts fresh records in all."""
    sources = None if sources is None else tuple(sources)
    mix = _check_params(num_prompts, heldout_fraction, seed, sources)
    pools, quotas = _pools(), _quotas(num_prompts, mix)
    # 1. each source's quota: a prefix of its pool in seeded-hash order, so prefix-stable in n
    picked = [sorted(pools[s], key=lambda r: hash64(seed, r["id"]))[: quotas[s]] for s in mix]
    # 2. interleave so that every prefix holds the sources in proportion
    keyed = [(Fraction(2 * j + 1, 2 * len(g)), gi, r) for gi, g in enumerate(picked) for j, r in enumerate(g)]
    records = copy.deepcopy([r for *_, r in sorted(keyed, key=lambda t: t[:2])])
    check_disjoint(records)  # the pools are filtered already: this guards the construction
    # 3. split on the text's hash alone, so a record's side does not depend on num_prompts or seed
    heldout = [r for r in records if _is_heldout(r, heldout_fraction)]
    train = [r for r in records if not _is_heldout(r, heldout_fraction)]
    counts = {s: {"share": round(float(share), 6), "available": len(pools[s])} for s, share in mix.items()}
    for split, split_records in (("train", train), ("heldout", heldout)):
        for s in counts:
            counts[s][split] = sum(r["source"] == s for r in split_records)
    stats = dict(
        version=PROMPT_SET_VERSION,
        python=f"CPython {sys.version_info.major}.{sys.version_info.minor}",
        benchmark_dataset_version=DATASET_VERSION,
        num_prompts=num_prompts,
        num_train=len(train),
        num_heldout=len(heldout),
        heldout_fraction=heldout_fraction,
        seed=seed,
        sources=counts,
        fingerprint=fingerprint(train + heldout),
    )
    return {"train": train, "heldout": heldout, "stats": stats}


def write_prompt_set(out_dir: str | Path, *, overwrite: bool = False, **kw) -> Path:
    """Build a set (`kw` as for build_prompt_set), write it to out_dir and return out_dir."""
    out = Path(out_dir)
    built = build_prompt_set(**kw)
    files = {
        f"{split}.jsonl": "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in built[split])
        for split in ("train", "heldout")
    }
    sha = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}
    files["stats.json"] = json.dumps({**built["stats"], "files_sha256": sha}, indent=1) + "\n"
    if out.exists() and not out.is_dir():
        raise SpecDecodeError(f"{out} exists and is not a directory; choose a directory for the prompt set")
    existing = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if existing and not overwrite:
        if all((out / n).is_file() and (out / n).read_text(encoding="utf-8") == t for n, t in files.items()):
            return out  # this very set is already there
        raise SpecDecodeError(
            f"{out} is not empty and does not hold this prompt set (it has {', '.join(existing[:5])}"
            f"{', ...' if len(existing) > 5 else ''}); choose another directory or pass overwrite=True"
        )
    out.mkdir(parents=True, exist_ok=True)
    temps = {name: out / f".{name}.tmp{os.getpid()}" for name in files}
    try:  # all temp files first, then the renames (stats.json last: it marks a complete set)
        for name, text in files.items():
            temps[name].write_text(text, encoding="utf-8")
        for name, tmp in temps.items():
            os.replace(tmp, out / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return out
