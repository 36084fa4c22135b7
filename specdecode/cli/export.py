"""`specdecode export`: a drafter in the layout vLLM or SGLang serves (docs/interop.md).

Contract: `specdecode export [DRAFTER] [--target T --method M]
--format speculators|specforge|specdecode --out DIR [--verifier NAME_OR_PATH]
[--num-speculative-tokens K] [--storage bf16|int8]`. DRAFTER is a checkpoint directory; without
it, the drafter shipped for `--target` and `--method` is exported. With `--target` the verifier's
facts (architectures, its embedding for speculators) are read from the target. A method the
format cannot express exactly is refused with the reason. `--format specdecode --storage int8`
rewrites one of our checkpoints with int8 weight matrices (per-row scales; about half the bytes):
the format the package's drafters ship in.
"""

from __future__ import annotations

import argparse

from specdecode.cli import options
from specdecode.drafters import method_record
from specdecode.drafters.checkpoint import checkpoint_path
from specdecode.errors import SpecDecodeError
from specdecode.interop import FORMATS, export_drafter
from specdecode.models.loader import load_model


def add_parsers(sub) -> None:
    e = sub.add_parser("export", help="write a drafter in the vLLM speculators or SGLang/SpecForge layout")
    e.add_argument("drafter", nargs="?", default=None, help="checkpoint directory (default: the shipped one)")
    e.add_argument("--target", default=None, help="the drafter's target: " + options.MODEL_HELP)
    e.add_argument("--method", default=None, help="with --target and no DRAFTER: whose shipped drafter")
    e.add_argument("--format", default="speculators", choices=FORMATS)
    options.add_out(e, "output directory")
    e.add_argument(
        "--verifier", default=None, help="verifier name or path the served config names (e.g. the hub id)"
    )
    e.add_argument("--num-speculative-tokens", type=int, default=None, help="K the config proposes")
    e.add_argument(
        "--storage",
        default="bf16",
        choices=("bf16", "int8"),
        help="--format specdecode: weight matrices in bf16 or int8 with per-row scales (half the bytes)",
    )
    options.add_dtype(e)
    e.set_defaults(handler=export)


def export(a: argparse.Namespace) -> None:
    target = load_model(a.target, dtype=a.dtype) if a.target else None
    path = a.drafter
    if path is None:
        if target is None or a.method is None:
            raise SpecDecodeError("give a drafter checkpoint directory, or --target and --method")
        path = checkpoint_path(method_record(a.method).checkpoint or a.method, target, None)
    out = export_drafter(
        path,
        a.out,
        fmt=a.format,
        verifier_name_or_path=a.verifier,
        target=target,
        num_speculative_tokens=a.num_speculative_tokens,
        storage=a.storage,
    )
    print(f"wrote {a.format} drafter: {out}")
