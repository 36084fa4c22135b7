"""The command line's shared options, each declared once, with its default in one place.

Contract: each function adds one option (or one group) to a parser; a command module calls the
ones it takes. (Flags that share a name but not a meaning stay with their command: --temperature
is one value for generate, a list for bench, a regen default or a calibration setting.)
`add_load_options(p)` adds the `LoadOptions` flags (target, method, drafter, K,
policy, verify mode, dtype, KV cache dtype, device, max batch, drafter options), whose defaults are
`build.LoadOptions`'s own; `load_options(args)` turns parsed arguments back into one
`LoadOptions` (what `specdecode.load`, the server and the harness take), never re-spelling them.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from specdecode.build import DEFAULT_TARGET, LoadOptions
from specdecode.drafters import METHODS
from specdecode.models.loader import DTYPE_CHOICES, KV_CACHE_DTYPES
from specdecode.policy import POLICIES

_DEFAULTS = LoadOptions()
MODEL_HELP = "model alias, HF directory or hub id"
DTYPE_HELP = (
    "weight format: auto (default: the formats measured fastest on this machine, cached), bf16 or "
    "fp32 (one format), int8 / int4 (weight-only quantized target: speculation is lossless with "
    "respect to the quantized model)"
)
DEVICE_HELP = "cpu, cuda, cuda:1 ... (default: cuda if available)"
# Flags that fill LoadOptions.drafter_options (method-specific; the drafter refuses the others).
DRAFTER_FLAGS = ("confidence_threshold", "threshold_on")


def add_target(p: argparse.ArgumentParser, required: bool = False) -> None:
    """--target: the commands that load a model for you default to the embedded one."""
    default = {"required": True} if required else {"default": DEFAULT_TARGET}
    p.add_argument("--target", help=MODEL_HELP, **default)


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=_DEFAULTS.dtype, choices=DTYPE_CHOICES, help=DTYPE_HELP)


def add_kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        default=_DEFAULTS.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype: auto (default: the activations' dtype) or bf16 (half the cache memory "
        "and bandwidth under fp32 activations; keys and values are rounded once as they are written)",
    )


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=_DEFAULTS.device, help=DEVICE_HELP)


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


def add_max_new_tokens(p: argparse.ArgumentParser, default: int = 128) -> None:
    p.add_argument("--max-new-tokens", type=int, default=default)


def add_top_p(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top-p", type=float, default=1.0)


def add_max_batch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch", type=int, default=_DEFAULTS.max_batch, help="requests decoded together")


def add_num_draft_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K, draft tokens per step")


def add_policy(p: argparse.ArgumentParser, choices: tuple[str, ...] = POLICIES) -> None:
    p.add_argument(
        "--policy",
        default=_DEFAULTS.policy,
        choices=list(choices),
        help="draft-length policy: adaptive (default) picks K per request from its acceptance and "
        "the measured verify cost; fixed always drafts K; scheduled admits drafts across the batch "
        "by expected tokens x measured steps/s (DSpark)",
    )


def add_out(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--out", required=True, help=help)


def add_data(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--data", required=True, help=help)


def add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true")


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The flags of `LoadOptions`, as one group."""
    g = p.add_argument_group("model and speculation")
    add_target(g)
    g.add_argument("--method", default=_DEFAULTS.method, help="one of: " + ", ".join(METHODS))
    g.add_argument(
        "--drafter",
        default=_DEFAULTS.drafter,
        help="drafter: a model for --method draft, a trained checkpoint directory for the learned "
        "methods (default: the drafter shipped for the target, if any)",
    )
    add_num_draft_tokens(g)
    add_policy(g)
    g.add_argument(
        "--verify-mode",
        default=_DEFAULTS.verify_mode,
        choices=["block", "rejection", "match"],
        help="sampled chains: block verification (default; accepts at least as many drafts in "
        "expectation), token-wise rejection sampling, or sample-then-match",
    )
    add_dtype(g)
    add_kv_cache_dtype(g)
    add_device(g)
    add_max_batch(g)
    g.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        help="dspark: stop a request's draft at the first position whose confidence is below this",
    )
    g.add_argument(
        "--threshold-on",
        default=None,
        choices=["survival", "confidence"],
        help="dspark: compare the threshold with the prefix survival a_k (default) or with c_k",
    )


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The `LoadOptions` the parsed flags spell (fields a command has no flag for keep their default)."""
    given = {f.name: getattr(args, f.name) for f in fields(LoadOptions) if hasattr(args, f.name)}
    given["drafter_options"] = {k: getattr(args, k) for k in DRAFTER_FLAGS}
    return LoadOptions(**given)
