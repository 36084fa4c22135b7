"""`specdecode models list | formats | install`: the offline models and prompt sets.

Contract: `list` prints every alias (installed or not, size) and the prompt sets; `formats NAME`
prints the weight formats `--dtype auto` measured for a model on this machine (`--remeasure`
forgets the cache first); `install NAME` installs a model alias or a prompt set and prints its path.
"""

from __future__ import annotations

import argparse
import shutil

from specdecode import assets
from specdecode.cli import options
from specdecode.datasets import PROMPT_SETS, ensure_prompt_set
from specdecode.models.formats import BUCKETS
from specdecode.models.loader import load_model


def add_parsers(sub) -> None:
    m = sub.add_parser("models", help="list or install the offline models and prompt sets")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="list aliases and prompt sets").set_defaults(handler=list_models)
    fm = msub.add_parser("formats", help="the weight formats --dtype auto measured for a model here")
    fm.add_argument("name", help=options.MODEL_HELP)
    fm.add_argument("--remeasure", action="store_true", help="forget cached measurements and measure again")
    fm.set_defaults(handler=formats)
    inst = msub.add_parser("install", help="install a model alias or a prompt set")
    inst.add_argument("name")
    inst.add_argument("--force", action="store_true", help="re-install even if present")
    inst.set_defaults(handler=install)


def list_models(a: argparse.Namespace) -> None:
    print(f"{'alias':20} {'installed':10} description")
    for row in assets.list_models():
        print(f"{row['alias']:20} {'yes' if row['installed'] else 'no':10} {row['description']}")
        print(f"{'':31} size: {row.get('size', '?')}")
    print("\nprompt sets:", ", ".join(PROMPT_SETS))
    print("Any local Hugging Face model directory or hub id works wherever a model is taken.")


def formats(a: argparse.Namespace) -> None:
    if a.remeasure:
        shutil.rmtree(assets.cache_dir() / "formats", ignore_errors=True)
    rec = load_model(a.name, dtype="auto", device="cpu").model.format_record
    print(f"plan: {rec.get('name', '?')}   ({rec.get('cpu', '?')}, {rec.get('capability', '?')}, "
          f"{rec.get('threads', '?')} threads)")  # fmt: skip
    head = "".join(f"{'M=' + str(m):>9}" for m in BUCKETS)
    print(f"{'kernel':14}{head}   (ms for one forward's products)")
    for k, row in rec.get("ms_per_forward", {}).items():
        print(f"{k:14}" + "".join(f"{'-' if v is None else f'{v:.1f}':>9}" for v in row))


def install(a: argparse.Namespace) -> None:
    if a.name in PROMPT_SETS:
        print(ensure_prompt_set(a.name))
    else:
        print(assets.install_model(a.name, force=a.force))
