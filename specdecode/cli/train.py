"""`specdecode train METHOD` and `specdecode calibrate`: drafters fitted to a target.

Contract: `train` runs a method's training task on regenerated data (several comma-separated
methods side by side, each in OUT/<method>, one target forward per batch; resumable: rerun with the
same --out); the method-specific flags go to that task only (`--mode native` only for mtp);
`--offline-vs-served` compares the run in --out instead of training (training/compare.py).
`calibrate` fits DSpark's per-position confidence temperatures on held-out prompts and writes
them into the checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.cli import options
from specdecode.drafters import REGISTRY
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.training.calibrate import calibrate as fit_temperatures
from specdecode.training.calibrate import format_table
from specdecode.training.compare import format_rows
from specdecode.training.ngram_table import MIN_SHARE, TABLE_WIDTH, build_table_checkpoint
from specdecode.training.run import TRAINABLE, run_comparison, run_training, split_methods, trainable
from specdecode.training.trainer import TrainConfig

_REGEN_HELP = "directory from `specdecode data regen` (several, comma-separated: their answers together)"


def add_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a drafter for a target on its regenerated data (resumable)")
    t.add_argument(
        "method",
        help=f"{', '.join(TRAINABLE)}; several comma-separated (e.g. dspark,eagle) train side by side on the "
        "same batches with one target forward per batch, each in OUT/<method>; or ngram-table (counts the "
        "n-gram table of the answers: seconds, no gradient; --min-count)",
    )
    options.add_target(t, required=True)
    options.add_data(t, _REGEN_HELP)
    options.add_out(t, "checkpoint directory (rerun to resume)")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--tokens-per-batch", type=int, default=4096)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=0, help="served-tau evaluation interval (0: at the end)")
    t.add_argument("--eval-prompts", type=int, default=16)
    t.add_argument(
        "--eval-data",
        default=None,
        help="held-out prompts for the served-tau evaluation: a prompt set (`data build`) or regen directory "
        "(default: --data)",
    )
    t.add_argument("--feature-cache", default=None, help="directory to cache target features on disk")
    t.add_argument("--bf16", action="store_true", help="bf16 autocast for the drafter")
    t.add_argument(
        "--min-count", type=int, default=4, help="ngram-table: contexts seen fewer times are left out"
    )
    t.add_argument(
        "--min-share",
        type=float,
        default=MIN_SHARE,
        help="ngram-table: a context whose most frequent next token has less than this share of its "
        "count ends the walk instead of drafting it",
    )
    t.add_argument(
        "--table-width",
        type=int,
        default=TABLE_WIDTH,
        help="ngram-table: next tokens kept per context, with their shares (ngram-table-tree's alternatives)",
    )
    options.add_seed(t)
    t.add_argument(
        "--init-from",
        default=None,
        help="start from this drafter checkpoint's weights (fresh optimiser and schedule; several methods: "
        "a directory with one checkpoint per method, DIR/<method>); ignored when --out resumes",
    )
    t.add_argument("--stop-at", type=int, default=None, help="save and stop after this step (resume later)")
    t.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="minutes: save and stop after the step that passes this much training time (resume later)",
    )
    t.add_argument(
        "--anneal-to-time-limit",
        action="store_true",
        help="end the learning-rate schedule at --time-limit (or at --steps, if reached sooner): "
        "a one-shot run on a machine of unknown speed",
    )
    t.add_argument(
        "--offline-vs-served",
        action="store_true",
        help="do not train: compare the run in --out (its trainer.pt), teacher-forced on the held-out "
        "regenerated answers of --data, with its served acceptance per draft position; writes "
        "OUT/offline_vs_served.json",
    )
    m = t.add_argument_group("method-specific (defaults per method from the drafter registry)")
    for flag, dest, kind in _TASK_FLAGS:
        if kind is bool:  # --x / --no-x; unset = the method's default
            m.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=_per_method(dest)
            )
        elif dest == "train_only":
            m.add_argument(
                flag,
                dest=dest,
                choices=["confidence"],
                default=None,
                help="dspark: train the confidence head alone, the other weights as --init-from gives them "
                "(e.g. on answers regenerated at the temperature it will serve at)",
            )
        else:
            m.add_argument(flag, dest=dest, type=kind, default=None, help=_per_method(dest))
    m.add_argument(
        "--mode",
        default="frozen",
        choices=["frozen", "native"],
        help="mtp: frozen target, or native joint training of target + modules (writes OUT/target)",
    )
    m.add_argument("--mtp-weight", type=float, default=0.3, help="mtp native: lambda of the MTP loss")
    m.add_argument(
        "--trunk-lr-scale", type=float, default=0.01, help="mtp native: target's lr as a fraction of --lr"
    )
    options.add_dtype(t)
    options.add_device(t)
    t.set_defaults(handler=train)

    c = sub.add_parser(
        "calibrate", help="fit DSpark's per-position confidence temperatures (STS) on held-out prompts"
    )
    options.add_target(c, required=True)
    c.add_argument(
        "--drafter", required=True, help="DSpark checkpoint directory (temperatures are written into it)"
    )
    options.add_data(c, "regenerated data or prompt set directory with heldout.jsonl")
    c.add_argument("--num-prompts", type=int, default=64)
    c.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the recorded runs")
    options.add_max_new_tokens(c)
    c.add_argument("--eval-fraction", type=float, default=0.33, help="rounds held out to report the ECE on")
    options.add_max_batch(c)
    c.add_argument(
        "--bias",
        action="store_true",
        help="also fit a per-position bias (not in the paper; for heads off by a constant, e.g. over-fitted)",
    )
    c.add_argument(
        "--rounds",
        default=None,
        help="file for the collected rounds: written after decoding; when it exists (same drafter weights, "
        "target, prompts and settings) the fit reads it instead of decoding again",
    )
    options.add_dtype(c)
    options.add_device(c)
    c.set_defaults(handler=calibrate)


def mask_token_arg(text: str) -> int | str:
    """--mask-token-id: a token id, 'auto' (the tokenizer's mask / unk / pad / eos token) or 'none'
    (a learned mask vector: not exportable)."""
    if text in ("auto", "none"):
        return text  # _task_options turns 'none' into None once it is known to be given
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a token id, 'auto' or 'none'") from None


# CLI flag -> the training-task setting it sets (Method.train_options keys).
_TASK_FLAGS = (
    ("--draft-vocab", "draft_vocab_size", int),
    ("--ttt-steps", "ttt_steps", int),
    ("--num-heads", "num_heads", int),
    ("--num-modules", "num_modules", int),
    ("--num-layers", "num_layers", int),
    ("--block-size", "block_size", int),
    ("--num-anchors", "num_anchors", int),
    ("--markov-rank", "markov_rank", int),
    ("--qk-norm", "qk_norm", bool),  # dflash/dspark: per-head q/k RMSNorm (exportable, see export)
    ("--mask-token-id", "mask_token_id", mask_token_arg),  # dflash/dspark: mask slots read its embedding
    ("--train-only", "train_only", str),  # dspark: "confidence" trains the confidence head alone
)


def _per_method(dest: str) -> str:
    return "; ".join(f"{m.name}: {m.train_options[dest]}" for m in REGISTRY if dest in m.train_options)


def _task_options(a: argparse.Namespace, method: str | None = None) -> dict:
    """The settings a method's training task takes: the flags given, else the method's defaults."""
    record = trainable(method or a.method)
    defaults = record.train_options if record is not None else {}  # run_training refuses the rest
    kw = {k: v if getattr(a, k) is None else getattr(a, k) for k, v in defaults.items()}
    if kw.get("mask_token_id") == "none":
        kw["mask_token_id"] = None
    if a.mode == "native":  # run_training refuses it for other methods
        kw |= {"mode": "native", "mtp_weight": a.mtp_weight, "trunk_lr_scale": a.trunk_lr_scale}
    return kw


def train(a: argparse.Namespace) -> None:
    if a.method == "ngram-table":  # counting, not gradient training
        target = load_model(a.target, dtype=a.dtype, device="cpu")
        summary = build_table_checkpoint(target, a.data, a.out, a.min_count, a.min_share, width=a.table_width)
        print(
            f"ngram-table: {summary['contexts']} contexts from {summary['answers']} answers "
            f"({summary['tokens']} tokens) in {summary['seconds']} s; drafter checkpoint: {a.out}"
        )
        return
    cfg = TrainConfig(
        out_dir=a.out,
        steps=a.steps,
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        grad_accum=a.grad_accum,
        tokens_per_batch=a.tokens_per_batch,
        max_len=a.max_len,
        checkpoint_every=a.checkpoint_every,
        eval_every=a.eval_every,
        eval_prompts=a.eval_prompts,
        seed=a.seed,
        bf16=a.bf16,
        stop_at=a.stop_at,
        time_limit_s=None if a.time_limit is None else 60 * a.time_limit,
        anneal_to_time_limit=a.anneal_to_time_limit,
    )
    methods = split_methods(a.method)
    many = len(methods) > 1
    record = trainable(methods[0])
    if a.train_only is not None and (many or record is None or "train_only" not in record.train_options):
        takers = ", ".join(m.name for m in REGISTRY if "train_only" in m.train_options)
        raise SpecDecodeError(f"--train-only applies to {takers} trained alone, not to {a.method}")
    if a.offline_vs_served:
        for m in methods:
            run_dir = Path(a.out) / m if many else Path(a.out)
            res = run_comparison(
                m,
                a.target,
                a.data,
                run_dir,
                cfg,
                _task_options(a, m),
                a.dtype,
                a.device,
                eval_data=a.eval_data,
            )
            (run_dir / "offline_vs_served.json").write_text(json.dumps(res, indent=1) + "\n")
            if many:
                print(f"{m} ({run_dir}):")
            print(format_rows(res))
        return
    run_training(
        a.method,
        a.target,
        a.data,
        a.out,
        cfg,
        {m: _task_options(a, m) for m in methods} if many else _task_options(a),
        dtype=a.dtype,
        device=a.device,
        feature_cache=a.feature_cache,
        eval_data=a.eval_data,
        init_from=a.init_from,
    )
    for m in methods:
        print(f"{m} drafter checkpoint: {Path(a.out) / m}" if many else f"drafter checkpoint: {a.out}")
    if a.mode == "native":
        print(f"jointly trained target: {a.out}/target (serve the drafter with --target {a.out}/target)")


def calibrate(a: argparse.Namespace) -> None:
    res = fit_temperatures(
        a.target,
        a.drafter,
        a.data,
        num_prompts=a.num_prompts,
        temperature=a.temperature,
        max_new_tokens=a.max_new_tokens,
        eval_fraction=a.eval_fraction,
        dtype=a.dtype,
        device=a.device,
        max_batch=a.max_batch,
        bias=a.bias,
        rounds=a.rounds,
    )
    print(
        f"{res['prompts']} prompts at T = {res['temperature']}: {res['rounds_fit']} rounds fit, "
        f"{res['rounds_eval']} rounds evaluated"
    )
    print(format_table(res))
    print(f"wrote the temperatures into {a.drafter}; calibration.json and reliability.png beside them")
