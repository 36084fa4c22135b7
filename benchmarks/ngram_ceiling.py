"""How far prompt lookup (`ngram`) can go on a prompt set: the ceiling its matches allow.

Prompt lookup drafts the continuation of the latest earlier match of the context's last n
tokens (n = 3, 2, 1, longest first, as `NgramDrafter` does). Whether that pays depends on how
often such a match exists and how many of its tokens the target then emits, which is a property
of the prompts and the target's answers, not of our runtime. This script measures it offline:
1. the target's greedy answers (`ar`, chat template, batch 1) to the first `--limit` prompts of
   each category;
2. at every answer position, the match prompt lookup finds there (its n) and the run of its
   continuation's tokens that equal the answer's next tokens (what verification would accept);
3. the cost of verifying k tokens on this machine, T(k) / T(1) (one forward of k new tokens
   over a 256-token cache, medians, as benchmarks/bench_runtime.py measures it);
4. the speed-up over `ar` each drafting rule would reach if drafting and the round's
   bookkeeping were free: tokens emitted / (sum over rounds of T(drafts + 1) / T(1)), walking
   each answer round by round. Rules: a fixed K; the best K per match length n (searched here,
   so optimistic for this sample); and the oracle that drafts exactly the tokens that will be
   accepted (no rule can beat it: every wasted draft costs verify time it does not have).
The bench harness's measured speed-up sits below these (drafting and per-round overhead are not
free); the oracle is the ceiling no prompt-lookup policy passes on these prompts.
Writes `<out>/report.md` and `<out>/results.json`. Usage:

    python benchmarks/ngram_ceiling.py --datasets code,chat --limit 12 --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import numpy as np
from bench_runtime import BLOCKS, _forward_ms, _setup  # benchmarks/ is the script's directory

from specdecode import load
from specdecode.bench.hardware import machine_info
from specdecode.datasets import load_categories
from specdecode.drafters.ngram import match_starts
from specdecode.request import GenerationRequest

NGRAMS = (3, 2, 1)  # NgramDrafter's defaults: max_ngram 3 down to min_ngram 1
RUN_CAP = 15  # accepted runs are counted up to this many tokens
T_TOKENS = (1, 2, 3, 4, 5, 6, 8, 11, 16)  # verify sizes timed; others interpolated
assert max(T_TOKENS) <= max(BLOCKS)  # bench_runtime's cache holds them


def position_matches(prompt: list[int], answer: list[int]) -> list[tuple[int, int, int]]:
    """Per answer position p: (n of prompt lookup's match on prompt + answer[:p], 0 for none;
    the accepted run: how many tokens of its continuation equal answer[p:]; the continuation's
    length)."""
    full = np.asarray(prompt + answer, dtype=np.int64)
    out = []
    for p in range(len(answer)):
        ctx = full[: len(prompt) + p]
        rec = (0, 0, 0)
        for n in NGRAMS:
            start = next(match_starts(ctx, n, n), None)
            if start is None:
                continue
            cont = ctx[start : start + RUN_CAP]
            want = answer[p : p + RUN_CAP]
            run = 0
            while run < min(len(cont), len(want)) and int(cont[run]) == want[run]:
                run += 1
            rec = (n, run, len(cont))
            break
        out.append(rec)
    return out


def verify_cost(tokens: int, cost: dict[int, float]) -> float:
    """T(tokens) / T(1), linear between the measured sizes (the largest beyond them)."""
    sizes = sorted(cost)
    if tokens >= sizes[-1]:
        return cost[sizes[-1]]
    for a, b in itertools.pairwise(sizes):
        if a <= tokens <= b:
            return cost[a] + (cost[b] - cost[a]) * (tokens - a) / (b - a)
    return cost[sizes[0]]


def walk(seqs: list[list[tuple[int, int, int]]], drafts_for, cost: dict[int, float]) -> float:
    """Speed-up over ar of a drafting rule, round by round through each answer: drafts_for(n,
    run) -> K (0: a plain step); a round emits min(run, K) + 1 tokens and costs T(K + 1) / T(1)."""
    emitted = spent = 0.0
    for recs in seqs:
        p = 0
        while p < len(recs):
            n, run, clen = recs[p]
            left = len(recs) - p
            k = min(drafts_for(n, run), clen, left - 1) if n else 0
            step = min(min(run, k) + 1, left)
            emitted += step
            spent += verify_cost(k + 1, cost) if k > 0 else 1.0
            p += step
    return emitted / spent


def measure_cost(target, reps: int) -> dict[int, float]:
    """T(k) / T(1) of one forward of k new tokens over bench_runtime's 256-token cache (medians)."""
    model = target.model
    cache, ids = _setup(model)  # room for max(BLOCKS) = max(T_TOKENS) new tokens
    times: dict[int, list[float]] = {k: [] for k in T_TOKENS}
    for r in range(reps + 2):
        for k in T_TOKENS if r % 2 else T_TOKENS[::-1]:
            ms = _forward_ms(model, cache, ids, k)
            if r >= 2:  # two warm-up passes
                times[k].append(ms)
    t1 = statistics.median(times[1])
    return {k: statistics.median(v) / t1 for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--datasets", default="code,chat")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=15, help="timed passes over the verify sizes")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sd = load(args.target, method="ar")
    tok = sd.tokenizer
    cost = measure_cost(sd.target, args.repeats)
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "cost": cost}
    results["categories"] = {}
    for cat in args.datasets.split(","):
        seqs = []
        for it in load_categories(cat, limit=args.limit):
            ids = tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"]
            req = GenerationRequest(prompt_ids=list(ids), max_new_tokens=args.max_new_tokens)
            answer = list(sd.decoder.generate([req])[0].token_ids)
            seqs.append(position_matches(list(ids), answer))
        flat = [r for s in seqs for r in s]
        by_n = {}
        for n in (*NGRAMS, 0):
            rows = [r for r in flat if r[0] == n]
            by_n[n] = {
                "positions": len(rows),
                "first_accepted": float(np.mean([r[1] >= 1 for r in rows])) if rows and n else None,
                "mean_run": float(np.mean([r[1] for r in rows])) if rows and n else None,
            }
        fixed = {k: walk(seqs, lambda n, run, k=k: k, cost) for k in range(1, 11)}
        grid = itertools.product((1, 3, 5, 7, 10, 14), (0, 1, 2, 3, 5, 7), (0, 1, 2, 3))  # K for n = 3, 2, 1
        rules = ((ks, walk(seqs, lambda n, run, ks=ks: ks[NGRAMS.index(n)], cost)) for ks in grid)
        best_k, best = max(rules, key=lambda t: t[1])
        oracle = walk(seqs, lambda n, run: run, cost)
        flat_verify = walk(seqs, lambda n, run: run, {1: 1.0})  # the oracle where any verify costs a step
        results["categories"][cat] = {
            "prompts": len(seqs),
            "positions": len(flat),
            "by_n": by_n,
            "fixed_k": fixed,
            "best_per_n": {"k_for_n3_n2_n1": list(best_k), "speedup": best},
            "oracle": oracle,
            "oracle_flat_verify": flat_verify,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "report.md").write_text(render(results))
    print(render(results))
    return 0


def render(res: dict) -> str:
    m, a = res["machine"], res["args"]
    cost = res["cost"]
    lines = [
        "# Prompt lookup's ceiling (offline)",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}. Target "
        f"{a['target']}, greedy answers of up to {a['max_new_tokens']} tokens to the first {a['limit']} "
        "prompts of each category (chat template).",
        "",
        f"Command: `python benchmarks/ngram_ceiling.py --datasets {a['datasets']} --limit {a['limit']} "
        f"--max-new-tokens {a['max_new_tokens']} --repeats {a['repeats']} --out {a['out']}`",
        "",
        "Verify cost measured here, T(k) / T(1) (one forward of k new tokens over a 256-token cache):",
        "",
        "| k | " + " | ".join(str(k) for k in cost) + " |",
        "|---|" + "---|" * len(cost),
        "| T(k) / T(1) | " + " | ".join(f"{v:.2f}" for v in cost.values()) + " |",
        "",
        "Matches by n (the longest n of 3, 2, 1 with an earlier occurrence; 0: none): how often the "
        "first drafted token is accepted, and the mean accepted run of the continuation (up to 15):",
        "",
        "| category | positions | none | n=1 (first accepted / run) | n=2 | n=3 |",
        "|---|---|---|---|---|---|",
    ]
    for cat, c in res["categories"].items():
        b = c["by_n"]

        def cell(n, b=b):
            d = b[str(n)] if str(n) in b else b[n]
            if not d["positions"]:
                return "0"
            return f"{d['positions']} ({d['first_accepted']:.2f} / {d['mean_run']:.2f})"

        none = b["0"] if "0" in b else b[0]
        row = [cat, c["positions"], none["positions"], cell(1), cell(2), cell(3)]
        lines.append("| " + " | ".join(map(str, row)) + " |")
    lines += [
        "",
        "Speed-up over `ar` with drafting and round bookkeeping free (upper bounds; the bench "
        "harness measures the real loop):",
        "",
        "| category | K=1 | K=2 | K=3 | K=4 | K=7 | K=10 | best K per n (n=3, 2, 1) | oracle "
        "| oracle, flat verify |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cat, c in res["categories"].items():
        f = {int(k): v for k, v in c["fixed_k"].items()}
        bp = c["best_per_n"]
        lines.append(
            f"| {cat} | "
            + " | ".join(f"{f[k]:.2f}x" for k in (1, 2, 3, 4, 7, 10))
            + f" | {bp['speedup']:.2f}x ({', '.join(map(str, bp['k_for_n3_n2_n1']))}) | {c['oracle']:.2f}x"
            + f" | {c['oracle_flat_verify']:.2f}x |"
        )
    lines += [
        "",
        "The oracle drafts exactly the tokens verification will accept and nothing on a miss: no "
        "prompt-lookup policy exceeds it on these answers at this verify cost. 'Flat verify' is the "
        "same oracle where a forward of any number of tokens costs one step (tokens per round: "
        "the bound set by the answers alone, whatever the hardware).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
