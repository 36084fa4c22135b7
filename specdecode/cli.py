"""Command line: `specdecode generate | demo | models`.

Contract (other tools rely on it):
  specdecode generate --target MODEL --method {ar,ngram,draft} [--drafter MODEL]
      [--num-draft-tokens K] [--temperature T] [--top-k K] [--top-p P] [--seed S]
      [--max-new-tokens N] [--dtype bf16|fp32] [--chat] (--prompt TEXT | --prompts FILE.jsonl) [--json]
  specdecode serve --target MODEL --method M [--drafter DIR] [--host 127.0.0.1] [--port 8000]
      [--max-batch N] [--max-model-len L] [--policy scheduled|...] [--max-queue Q]
      [--limit-concurrency C] [--timeout-keep-alive S] [--timeout-header S] [--timeout-body S]
      OpenAI-compatible HTTP server (specdecode/engine/server.py) until SIGINT / SIGTERM.
With --json: one JSON object per prompt on stdout (id, text, token_ids, num_new_tokens,
num_steps, tau, accepted_per_position, decode_time_s, tokens_per_s, ...). Without it, text
streams to stdout and a summary goes to stderr. User errors print one line `error: ...` and
exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specdecode.drafters import METHODS
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import DTYPE_CHOICES

DTYPE_HELP = (
    "weight format: auto (default: the formats measured fastest on this machine, cached), bf16 or "
    "fp32 (one format), int8 / int4 (weight-only quantized target: speculation is lossless with "
    "respect to the quantized model)"
)

DEMO_PROMPTS = [
    (
        "Here is a Python function:\n\n"
        "def mean(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total / len(values)\n\n"
        "Rewrite it so that it returns 0.0 for an empty list. Reply with the full function only."
    ),
    (
        "Summarize this paragraph in two sentences: Speculative decoding lets a small drafter guess "
        "several tokens ahead while the large target model checks all of them in one forward pass. "
        "Rejection sampling keeps the output distribution exactly the target's, so the text does not "
        "change, only the speed does. The speed-up depends on how often the drafter's guesses are accepted."
    ),
    "What are three tips for writing clear technical documentation?",
]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="alias, Hugging Face directory or hub id")
    p.add_argument("--method", default="ar", help="one of: " + ", ".join(METHODS))
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter: a model for --method draft, a trained checkpoint directory for the learned "
        "methods (default: the drafter shipped for the target, if any)",
    )
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K, draft tokens per step")
    p.add_argument(
        "--policy",
        default="adaptive",
        choices=["fixed", "adaptive", "scheduled", "scheduled-production"],
        help="draft-length policy: adaptive (default) picks K per request from its acceptance and "
        "the measured verify cost; fixed always drafts K; scheduled admits drafts across the batch "
        "by expected tokens x measured steps/s (DSpark)",
    )
    p.add_argument(
        "--verify-mode",
        default="rejection",
        choices=["rejection", "match"],
        help="rejection sampling (default) or sample-then-match",
    )
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        help="dspark: stop a request's draft at the first position whose confidence is below this",
    )
    p.add_argument(
        "--threshold-on",
        default=None,
        choices=["survival", "confidence"],
        help="dspark: compare the threshold with the prefix survival a_k (default) or with c_k",
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt or a JSONL file of prompts")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", help="JSONL file: {id, prompt} or {id, messages} per line")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")

    d = sub.add_parser("demo", help="compare ar and ngram on the embedded default model")
    d.add_argument("--target", default="smollm2-135m")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)

    b = sub.add_parser("bench", help="benchmark methods side by side (report + plots)")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--methods", default="ar,ngram", help="comma-separated; ar is always included")
    b.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="METHOD=MODEL",
        help="drafter model per method, e.g. draft=qwen2.5-coder-0.5b (repeatable)",
    )
    b.add_argument("--datasets", default="all", help="categories (comma-separated), 'all', or FILE.jsonl")
    b.add_argument("--limit", type=int, default=8, help="prompts per category")
    b.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    b.add_argument("--batch-size", type=int, nargs="+", default=[1])
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--peers", default="", help="comma-separated: hf, hf-assisted, hf-lookup")
    b.add_argument("--num-draft-tokens", type=int, default=None)
    b.add_argument("--policy", default="adaptive", choices=["fixed", "adaptive"])
    b.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    b.add_argument("--device", default=None)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", required=True, help="output directory (results.json, report.md, plots)")

    dp = sub.add_parser("data", help="training data for drafters")
    dsub = dp.add_subparsers(dest="data_command", required=True)
    db = dsub.add_parser("build", help="write a training prompt set disjoint from the benchmark prompts")
    db.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl, stats.json")
    db.add_argument("--num-prompts", type=int, default=4000)
    db.add_argument("--heldout-fraction", type=float, default=0.05)
    db.add_argument("--seed", type=int, default=0)
    db.add_argument("--overwrite", action="store_true")
    pk = dsub.add_parser("pack", help="compress regenerated data into one committable file (uint16 ids)")
    pk.add_argument("--data", required=True, help="directory from `specdecode data regen`")
    pk.add_argument("--out", required=True, help="output .npz file")
    upk = dsub.add_parser("unpack", help="write a packed file back as a regen directory for training")
    upk.add_argument("file", help=".npz file from `specdecode data pack`")
    upk.add_argument("--out", required=True, help="regen directory to write")
    dr = dsub.add_parser("regen", help="let the target write the responses of a prompt set (resumable)")
    dr.add_argument("--target", required=True, help="model alias, HF directory or hub id")
    dr.add_argument("--data", required=True, help="prompt set directory from `specdecode data build`")
    dr.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl, meta.json")
    dr.add_argument("--max-new-tokens", type=int, default=256)
    dr.add_argument(
        "--temperature", type=float, default=None,
        help="default: the target's usual temperature (its generation config, else 0.7); 0 = greedy",
    )  # fmt: skip
    dr.add_argument("--top-p", type=float, default=1.0)
    dr.add_argument("--batch-size", type=int, default=32, help="answers decoded at once")
    dr.add_argument("--samples", type=int, default=1, help="answers per prompt, each with its own seed")
    dr.add_argument("--limit", type=int, default=None, help="first N prompts of each split")
    dr.add_argument("--splits", default="train,heldout")
    dr.add_argument("--seed", type=int, default=0)
    dr.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    dr.add_argument("--device", default=None)
    dr.add_argument("--overwrite", action="store_true")

    t = sub.add_parser("train", help="train a drafter for a target on its regenerated data (resumable)")
    t.add_argument("method", help="draft, medusa, mtp, eagle, dflash, dspark")
    t.add_argument("--target", required=True, help="model alias, HF directory or hub id")
    t.add_argument("--data", required=True, help="directory from `specdecode data regen`")
    t.add_argument("--out", required=True, help="checkpoint directory (rerun to resume)")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--tokens-per-batch", type=int, default=4096)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=0, help="served-tau evaluation interval (0: at the end)")
    t.add_argument("--eval-prompts", type=int, default=16)
    t.add_argument("--feature-cache", default=None, help="directory to cache target features on disk")
    t.add_argument("--bf16", action="store_true", help="bf16 autocast for the drafter")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--stop-at", type=int, default=None, help="save and stop after this step (resume later)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="eagle: draft vocabulary size")
    t.add_argument("--ttt-steps", type=int, default=3, help="eagle: training-time-test unroll steps")
    t.add_argument("--num-heads", type=int, default=4, help="medusa: number of heads")
    t.add_argument("--num-modules", type=int, default=3, help="mtp: number of chained modules")
    t.add_argument(
        "--mode",
        default="frozen",
        choices=["frozen", "native"],
        help="mtp: frozen target, or native joint training of target + modules (writes OUT/target)",
    )
    t.add_argument("--mtp-weight", type=float, default=0.3, help="mtp native: lambda of the MTP loss")
    t.add_argument(
        "--trunk-lr-scale", type=float, default=0.01, help="mtp native: target's lr as a fraction of --lr"
    )
    t.add_argument(
        "--num-layers", type=int, default=None, help="draft: layers of the draft model (4); dflash/dspark: 2"
    )
    t.add_argument("--block-size", type=int, default=None, help="dflash: slots per block (8); dspark: (7)")
    t.add_argument("--num-anchors", type=int, default=32, help="dflash/dspark: blocks per training sequence")
    t.add_argument("--markov-rank", type=int, default=256, help="dspark: rank r of the Markov head")
    t.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    t.add_argument("--device", default=None)

    c = sub.add_parser(
        "calibrate", help="fit DSpark's per-position confidence temperatures (STS) on held-out prompts"
    )
    c.add_argument("--target", required=True, help="model alias, HF directory or hub id")
    c.add_argument(
        "--drafter", required=True, help="DSpark checkpoint directory (temperatures are written into it)"
    )
    c.add_argument(
        "--data", required=True, help="regenerated data or prompt set directory with heldout.jsonl"
    )
    c.add_argument("--num-prompts", type=int, default=64)
    c.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the recorded runs")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--eval-fraction", type=float, default=0.33, help="rounds held out to report the ECE on")
    c.add_argument("--max-batch", type=int, default=8)
    c.add_argument(
        "--bias",
        action="store_true",
        help="also fit a per-position bias (not in the paper; for heads off by a constant, e.g. over-fitted)",
    )
    c.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    c.add_argument("--device", default=None)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_model_args(sv)
    sv.set_defaults(policy="scheduled", max_batch=8)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-model-len", type=int, default=None, help="served context (default <= 4096)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (then 429)")
    sv.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    sv.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds given to in-flight work")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.add_argument(
        "--limit-concurrency", type=int, default=None, help="open connections + requests (256); beyond: 503"
    )
    sv.add_argument("--timeout-keep-alive", type=float, default=None, help="idle keep-alive seconds (5)")
    sv.add_argument("--timeout-header", type=float, default=None, help="seconds for a request head (10)")
    sv.add_argument("--timeout-body", type=float, default=None, help="seconds for a request body (30)")

    m = sub.add_parser("models", help="list or install the offline models and prompt sets")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="list aliases and prompt sets")
    fm = msub.add_parser("formats", help="the weight formats --dtype auto measured for a model here")
    fm.add_argument("name", help="model alias, HF directory or hub id")
    fm.add_argument("--remeasure", action="store_true", help="forget cached measurements and measure again")
    inst = msub.add_parser("install", help="install a model alias or a prompt set")
    inst.add_argument("name")
    inst.add_argument("--force", action="store_true", help="re-install even if present")
    return ap


def _drafter_options(a) -> dict:
    return {"confidence_threshold": a.confidence_threshold, "threshold_on": a.threshold_on}


def _cmd_generate(a) -> None:
    import specdecode
    from specdecode.prompts import read_prompts_jsonl

    if a.max_new_tokens < 1:
        raise SpecDecodeError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    sd = specdecode.load(
        a.target,
        a.method,
        a.drafter,
        num_draft_tokens=a.num_draft_tokens,
        policy=a.policy,
        dtype=a.dtype,
        device=a.device,
        max_batch=a.max_batch,
        verify_mode=a.verify_mode,
        drafter_options=_drafter_options(a),
    )
    kw = dict(
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        stop=tuple(a.stop),
        chat=a.chat,
        ignore_eos=a.ignore_eos,
    )
    if a.prompts:
        items = read_prompts_jsonl(a.prompts)
        prompt = [{k: v for k, v in vars(it).items() if v not in (None, ())} for it in items]
        reqs = sd.requests(prompt, **kw)
    else:
        reqs = sd.requests(a.prompt, **kw)
    if a.json:
        for res in sd.decoder.generate(reqs):
            print(json.dumps(res.to_json(), ensure_ascii=False), flush=True)
        return
    results = []
    if len(reqs) == 1:
        for ev in sd.decoder.stream(reqs):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.result:
                results.append(ev.result)
        sys.stdout.write("\n")
    else:
        results = sd.decoder.generate(reqs)
        for res in results:
            print(f"=== {res.id} ===\n{res.text}\n")
    n = sum(r.num_new_tokens for r in results)
    steps = sum(r.num_steps for r in results)
    dt = sum(r.decode_time_s for r in results)
    print(
        f"[{a.method}] {len(results)} prompt(s), {n} tokens in {steps} steps, tau {n / max(steps, 1):.2f}, "
        f"{n / dt if dt else 0:.1f} tokens/s",
        file=sys.stderr,
    )


def _cmd_demo(a) -> None:
    import specdecode
    from specdecode.models.loader import load_model

    print(f"Loading {a.target} ({a.dtype}) ...", file=sys.stderr)
    target = load_model(a.target, dtype=a.dtype)
    ar = specdecode.load(target, "ar")
    ng = specdecode.load(target, "ngram")
    kw = dict(max_new_tokens=a.max_new_tokens, chat=True)
    ar.generate("Hello!", max_new_tokens=8, chat=True)  # warm-up
    ng.generate("Hello!", max_new_tokens=8, chat=True)
    rows = []
    for i, prompt in enumerate(DEMO_PROMPTS):
        t0 = time.perf_counter()
        r_ar = ar.generate(prompt, **kw)
        r_ng = ng.generate(prompt, **kw)
        same = r_ar.token_ids == r_ng.token_ids
        rows.append((i, r_ar, r_ng, same))
        print(f"\n--- prompt {i}: {prompt[:70]!r}...\n{r_ng.text.strip()}\n", flush=True)
        print(
            f"    ar {r_ar.tokens_per_s:.1f} tok/s | ngram {r_ng.tokens_per_s:.1f} tok/s, tau {r_ng.tau:.2f} "
            f"| speed-up {r_ng.tokens_per_s / r_ar.tokens_per_s:.2f}x | identical output: {same} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    t_ar = sum(r[1].decode_time_s for r in rows)
    t_ng = sum(r[2].decode_time_s for r in rows)
    taus = sum(r[2].num_new_tokens for r in rows) / sum(r[2].num_steps for r in rows)
    same = sum(r[3] for r in rows)
    print(
        f"\nOverall: ngram tau {taus:.2f}, decode speed-up over ar {t_ar / t_ng:.2f}x, "
        f"identical greedy output on {same}/{len(rows)} prompts."
    )
    if a.dtype != "fp32" and same < len(rows):
        print(
            f"Note: with --dtype {a.dtype} a multi-token verify pass may round differently from "
            "one-token steps (another kernel or format), so a near-tie can flip a greedy token; "
            "with --dtype fp32 outputs match token for token."
        )


def _cmd_bench(a) -> None:
    from specdecode.bench.harness import BenchConfig, run_bench

    drafters = {}
    for spec in a.drafter:
        method, sep, model = spec.partition("=")
        if not sep or not method or not model:
            raise SpecDecodeError(
                f"--drafter takes METHOD=MODEL (e.g. draft=qwen2.5-coder-0.5b), got {spec!r}"
            )
        drafters[method] = model
    cfg = BenchConfig(
        target=a.target,
        methods=[m for m in a.methods.split(",") if m],
        drafters=drafters,
        datasets=a.datasets,
        limit=a.limit,
        temperatures=a.temperature,
        batch_sizes=a.batch_size,
        max_new_tokens=a.max_new_tokens,
        repeats=a.repeats,
        peers=[p for p in a.peers.split(",") if p],
        num_draft_tokens=a.num_draft_tokens,
        policy=a.policy,
        dtype=a.dtype,
        device=a.device,
        seed=a.seed,
        out=a.out,
    )
    out = run_bench(cfg)
    print((out / "report.md").read_text())


def _cmd_data(a) -> None:
    import json as _json

    if a.data_command in ("pack", "unpack"):
        from specdecode.training.packed import pack_regen, unpack_regen

        counts = pack_regen(a.data, a.out) if a.data_command == "pack" else unpack_regen(a.file, a.out)
        for split, c in counts.items():
            print(f"{split}: {c['records']} records, {c['tokens']} tokens")
        print(f"wrote {a.out}")
        return
    if a.data_command == "regen":
        from specdecode.models.loader import load_model
        from specdecode.training.regen import regenerate

        target = load_model(a.target, dtype=a.dtype, device=a.device)
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
        return
    from specdecode.training.prompts import write_prompt_set

    out = write_prompt_set(
        a.out,
        num_prompts=a.num_prompts,
        heldout_fraction=a.heldout_fraction,
        seed=a.seed,
        overwrite=a.overwrite,
    )
    stats = _json.loads((out / "stats.json").read_text())
    print(
        f"wrote {out}: {stats.get('num_train', '?')} train / {stats.get('num_heldout', '?')} held-out prompts"
    )


def _cmd_train(a) -> None:
    from specdecode.training.run import run_training
    from specdecode.training.trainer import TrainConfig

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
    )
    kw = {
        "eagle": {"draft_vocab_size": a.draft_vocab, "ttt_steps": a.ttt_steps},
        "medusa": {"draft_vocab_size": a.draft_vocab, "num_heads": a.num_heads},
        "mtp": {"draft_vocab_size": a.draft_vocab, "num_modules": a.num_modules},
        "draft": {"draft_vocab_size": a.draft_vocab, "num_layers": a.num_layers or 4},
        "dflash": {
            "draft_vocab_size": a.draft_vocab,
            "num_layers": a.num_layers or 2,
            "block_size": a.block_size or 8,
            "num_anchors": a.num_anchors,
        },
        "dspark": {
            "draft_vocab_size": a.draft_vocab,
            "num_layers": a.num_layers or 2,
            "block_size": a.block_size or 7,
            "num_anchors": a.num_anchors,
            "markov_rank": a.markov_rank,
        },
    }.get(a.method, {})
    if a.mode == "native":  # run_training refuses it for other methods
        kw |= {"mode": "native", "mtp_weight": a.mtp_weight, "trunk_lr_scale": a.trunk_lr_scale}
    run_training(
        a.method,
        a.target,
        a.data,
        a.out,
        cfg,
        kw,
        dtype=a.dtype,
        device=a.device,
        feature_cache=a.feature_cache,
    )
    print(f"drafter checkpoint: {a.out}")
    if a.mode == "native":
        print(f"jointly trained target: {a.out}/target (serve the drafter with --target {a.out}/target)")


def _cmd_calibrate(a) -> None:
    from specdecode.drafters.dspark.calibrate import calibrate, format_table

    res = calibrate(
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
    )
    print(
        f"{res['prompts']} prompts at T = {res['temperature']}: {res['rounds_fit']} rounds fit, "
        f"{res['rounds_eval']} rounds evaluated"
    )
    print(format_table(res))
    print(f"wrote the temperatures into {a.drafter}; calibration.json and reliability.png beside them")


def _cmd_serve(a) -> None:
    from specdecode.engine.server import ServerLimits, serve

    given = {
        "limit_concurrency": a.limit_concurrency,
        "keep_alive_s": a.timeout_keep_alive,
        "header_timeout_s": a.timeout_header,
        "body_timeout_s": a.timeout_body,
    }
    serve(
        a.target,
        a.method,
        a.drafter,
        host=a.host,
        port=a.port,
        shutdown_grace_s=a.shutdown_grace,
        log_level=a.log_level,
        num_draft_tokens=a.num_draft_tokens,
        policy=a.policy,
        dtype=a.dtype,
        device=a.device,
        max_batch=a.max_batch,
        max_model_len=a.max_model_len,
        max_queue=a.max_queue,
        verify_mode=a.verify_mode,
        drafter_options=_drafter_options(a),
        served_model_name=a.served_model_name,
        limits=ServerLimits(**{k: v for k, v in given.items() if v is not None}),
    )


def _cmd_models(a) -> None:
    from specdecode import assets

    if a.models_command == "list":
        print(f"{'alias':20} {'installed':10} description")
        for row in assets.list_models():
            print(f"{row['alias']:20} {'yes' if row['installed'] else 'no':10} {row['description']}")
            print(f"{'':31} size: {row.get('size', '?')}")
        print("\nprompt sets:", ", ".join(assets.PROMPT_SETS))
        print("Any local Hugging Face model directory or hub id works wherever a model is taken.")
        return
    if a.models_command == "formats":
        from specdecode.models.formats import BUCKETS
        from specdecode.models.loader import load_model

        if a.remeasure:
            import shutil

            shutil.rmtree(assets.cache_dir() / "formats", ignore_errors=True)
        rec = load_model(a.name, dtype="auto", device="cpu").model.format_record
        print(f"plan: {rec.get('name', '?')}   ({rec.get('cpu', '?')}, {rec.get('capability', '?')}, "
              f"{rec.get('threads', '?')} threads)")  # fmt: skip
        head = "".join(f"{'M=' + str(m):>9}" for m in BUCKETS)
        print(f"{'kernel':14}{head}   (ms for one forward's products)")
        for k, row in rec.get("ms_per_forward", {}).items():
            print(f"{k:14}" + "".join(f"{'-' if v is None else f'{v:.1f}':>9}" for v in row))
        return
    if a.name in assets.PROMPT_SETS:
        print(assets.ensure_prompt_set(a.name))
    else:
        print(assets.install_model(a.name, force=a.force))


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        {
            "generate": _cmd_generate,
            "demo": _cmd_demo,
            "bench": _cmd_bench,
            "data": _cmd_data,
            "train": _cmd_train,
            "models": _cmd_models,
            "serve": _cmd_serve,
            "calibrate": _cmd_calibrate,
        }[a.command](a)
    except SpecDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
