"""`specdecode generate` (a prompt or a JSONL file of prompts) and `specdecode demo`.

Contract: `generate` prints one JSON object per prompt with --json, else streams the text of a
single prompt (or prints each result of a file) and a summary line on stderr. `demo` compares
`ar` and a speculative method (`--method`, default `DEMO_METHOD`) on a fixed set of prompts
over one shared target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specdecode.build import LoadOptions, build
from specdecode.chat import read_prompts_jsonl
from specdecode.cli import options
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model

DEMO_METHOD = "eagle"
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


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt or a JSONL file of prompts")
    options.add_load_options(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", help="JSONL file: {id, prompt} or {id, messages} per line")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    options.add_top_p(g)
    options.add_seed(g)
    options.add_max_new_tokens(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    g.set_defaults(handler=generate)

    d = sub.add_parser("demo", help="compare ar and speculation on the embedded default model")
    options.add_target(d)
    d.add_argument(
        "--method",
        default=DEMO_METHOD,
        help=f"the speculative method compared with ar (default {DEMO_METHOD}: EAGLE-3, the fastest in the "
        "benchmark reports on both CPU kinds, shipped for the default model)",
    )
    options.add_max_new_tokens(d, default=96)
    options.add_dtype(d)
    d.set_defaults(handler=demo)


def generate(a: argparse.Namespace) -> None:
    if a.max_new_tokens < 1:
        raise SpecDecodeError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    sd = build(options.load_options(a))
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


def demo(a: argparse.Namespace) -> None:
    print(f"Loading {a.target} ({a.dtype}) ...", file=sys.stderr)
    target = load_model(a.target, dtype=a.dtype)
    ar = build(LoadOptions(target, "ar"))
    sd = build(LoadOptions(target, a.method))
    kw = dict(max_new_tokens=a.max_new_tokens, chat=True)
    ar.generate("Hello!", max_new_tokens=8, chat=True)  # warm-up
    sd.generate("Hello!", max_new_tokens=8, chat=True)
    rows = []
    for i, prompt in enumerate(DEMO_PROMPTS):
        t0 = time.perf_counter()
        r_ar = ar.generate(prompt, **kw)
        r_sd = sd.generate(prompt, **kw)
        same = r_ar.token_ids == r_sd.token_ids
        rows.append((i, r_ar, r_sd, same))
        print(f"\n--- prompt {i}: {prompt[:70]!r}...\n{r_sd.text.strip()}\n", flush=True)
        print(
            f"    ar {r_ar.tokens_per_s:.1f} tok/s | {a.method} {r_sd.tokens_per_s:.1f} tok/s, "
            f"tau {r_sd.tau:.2f} "
            f"| speed-up {r_sd.tokens_per_s / r_ar.tokens_per_s:.2f}x | identical output: {same} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    t_ar = sum(r[1].decode_time_s for r in rows)
    t_sd = sum(r[2].decode_time_s for r in rows)
    taus = sum(r[2].num_new_tokens for r in rows) / sum(r[2].num_steps for r in rows)
    same = sum(r[3] for r in rows)
    print(
        f"\nOverall: {a.method} tau {taus:.2f}, decode speed-up over ar {t_ar / t_sd:.2f}x, "
        f"identical greedy output on {same}/{len(rows)} prompts."
    )
    if a.dtype != "fp32" and same < len(rows):
        print(
            f"Note: with --dtype {a.dtype} a multi-token verify pass may round differently from "
            "one-token steps (another kernel or format), so a near-tie can flip a greedy token; "
            "with --dtype fp32 outputs match token for token."
        )
