"""`specdecode data build | regen | pack | unpack`: training data for drafters.

Contract: `build` writes a training prompt set disjoint from the benchmark prompts
(`training.prompts`); `regen` lets the target write the responses (resumable, `training.regen`);
`pack` / `unpack` turn a regen directory into one committable file and back (`training.packed`).
Each prints what it wrote.
"""

from __future__ import annotations

import argparse
import json

from specdecode.cli import options
from specdecode.models.loader import load_model
from specdecode.training.packed import pack_regen, unpack_regen
from specdecode.training.prompts import write_prompt_set
from specdecode.training.regen import regenerate


def add_parsers(sub) -> None:
    dp = sub.add_parser("data", help="training data for drafters")
    dsub = dp.add_subparsers(dest="data_command", required=True)
    db = dsub.add_parser("build", help="write a training prompt set disjoint from the benchmark prompts")
    options.add_out(db, "directory for train.jsonl, heldout.jsonl, stats.json")
    db.add_argument("--num-prompts", type=int, default=4000)
    db.add_argument("--heldout-fraction", type=float, default=0.05)
    db.add_argument(
        "--sources",
        default=None,
        help="comma-separated sources to draw from (default: all; code,docs,math,instructions rebuilds "
        "a version 1 set)",
    )
    options.add_seed(db)
    options.add_overwrite(db)
    db.set_defaults(handler=build)

    pk = dsub.add_parser("pack", help="compress regenerated data into one committable file (uint16 ids)")
    options.add_data(pk, "directory from `specdecode data regen`")
    options.add_out(pk, "output .npz file")
    pk.set_defaults(handler=pack)
    upk = dsub.add_parser("unpack", help="write a packed file back as a regen directory for training")
    upk.add_argument("file", help=".npz file from `specdecode data pack`")
    options.add_out(upk, "regen directory to write")
    upk.set_defaults(handler=unpack)

    dr = dsub.add_parser("regen", help="let the target write the responses of a prompt set (resumable)")
    options.add_target(dr, required=True)
    options.add_data(dr, "prompt set directory from `specdecode data build`")
    options.add_out(dr, "directory for train.jsonl, heldout.jsonl, meta.json")
    options.add_max_new_tokens(dr, default=256)
    dr.add_argument(
        "--temperature", type=float, default=None,
        help="default: the target's usual temperature (its generation config, else 0.7); 0 = greedy",
    )  # fmt: skip
    options.add_top_p(dr)
    dr.add_argument("--batch-size", type=int, default=32, help="answers decoded at once")
    dr.add_argument("--samples", type=int, default=1, help="answers per prompt, each with its own seed")
    dr.add_argument("--limit", type=int, default=None, help="first N prompts of each split")
    dr.add_argument("--splits", default="train,heldout")
    options.add_seed(dr)
    options.add_dtype(dr)
    options.add_kv_cache_dtype(dr)
    options.add_device(dr)
    options.add_overwrite(dr)
    dr.set_defaults(handler=regen)


def _print_counts(counts: dict, out: str) -> None:
    for split, c in counts.items():
        print(f"{split}: {c['records']} records, {c['tokens']} tokens")
    print(f"wrote {out}")


def pack(a: argparse.Namespace) -> None:
    _print_counts(pack_regen(a.data, a.out), a.out)


def unpack(a: argparse.Namespace) -> None:
    _print_counts(unpack_regen(a.file, a.out), a.out)


def regen(a: argparse.Namespace) -> None:
    target = load_model(a.target, dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype)
    out = regenerate(
        target,
        a.data,
        a.out,
        splits=tuple(s for s in a.splits.split(",") if s),
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        batch_size=a.batch_size,
        samples=a.samples,
        limit=a.limit,
        seed=a.seed,
        overwrite=a.overwrite,
    )
    print(
        f"wrote {a.out}: {out['answers']} answers, {out['tokens']} tokens in {out['seconds']:.0f} s "
        f"({out['tokens_per_s']:.0f} tokens/s); {out['skipped_prompts']} prompts too long were skipped"
    )


def build(a: argparse.Namespace) -> None:
    out = write_prompt_set(
        a.out,
        num_prompts=a.num_prompts,
        heldout_fraction=a.heldout_fraction,
        seed=a.seed,
        sources=None if a.sources is None else [s.strip() for s in a.sources.split(",") if s.strip()],
        overwrite=a.overwrite,
    )
    stats = json.loads((out / "stats.json").read_text())
    print(
        f"wrote {out}: {stats.get('num_train', '?')} train / {stats.get('num_heldout', '?')} held-out prompts"
    )
