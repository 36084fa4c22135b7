"""Step-cost profiles: how long one forward of N new tokens takes on this machine.

Contract: `step_cost_curves(model, fingerprint, max_tokens)` returns {context: costs} with
`costs[n-1]` = median seconds of a forward of n new tokens (n = 1..max_tokens) over `context`
committed tokens, batch 1, at `CONTEXTS` (256, 1024, 2048; those the model's window holds): every
size timed in turn, then `monotone_envelope` (never more than a larger n costs). The attention of
a verify block grows with its rows times the context, so on the AMX kind 8 tokens cost 1.3 one-token
steps over 256 tokens and 1.6 over 1,024. `step_costs(...)` is the 256-token curve. Profiles are cached as
JSON under `<cache_dir>/profiles/`, keyed by the model's fingerprint, dtype, weight formats
(`info.format`), device, torch version, CPU capability, thread count and the sources of our
compiled kernels, so a machine measures once and later runs make the same draft-length
decisions (a seeded sampled run stays reproducible), and a faster runtime is measured anew.
Every profile here is a `specdecode.measured` record: one measured while other work shared the
cores is provisional and measured again at the next uses (the quietest stays).

Why: whether verifying K extra tokens is nearly free depends on the hardware. With AMX (or a
GPU) a bf16 forward of 8 tokens costs about one of 1 token; on an AVX2-only CPU it costs ~5x.
The adaptive draft-length policy reads these costs instead of assuming either.

`draft_round_costs(ident, k, round_seconds, points=())` is what a learned drafter's round costs
(fixed + per token, and the curve over K through every K it timed: 1, k and the drafter's
`points`), timed once per drafter architecture, target and machine; with `step_seconds`, also
what a sampled step costs beyond a greedy one: greedy and sampled steps timed back to back
(`SAMPLED_REPEATS` times, in alternating order), the median over the pairs of orders of the
paired differences. That
extra is a fraction of a millisecond measured on steps of ~10 ms: from one timing of each side
it came out anywhere between -1.6 and +3.5 ms on a drifting host, and a cached +1.6 ms at K = 1
kept T = 1 requests from drafting on that machine for good. `interp(xs, ys, x)`: the
piecewise-linear helper it and the step-cost model (`costs.py`) read curves with.

`batch_step_costs(model, fingerprint, rows, blocks, contexts)` is the serving-time profile the
DSpark-style scheduler reads (SPS, target steps per second): `times[c][r][b]` = seconds of one
forward of `rows[r]` requests x `blocks[b]` new tokens each over `contexts[c]` committed tokens
per request (the loop pads ragged blocks, so that is the work a verify step does). It is cached
the same way, under a key that also names the grid.
"""

from __future__ import annotations

import bisect
import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from specdecode.assets import cache_dir
from specdecode.measured import cached_measurement
from specdecode.models import kernels

CONTEXT = 256
CONTEXTS = (CONTEXT, 1024, 2048)  # a verify block over a long context costs more than over a short one


def _key(model, fingerprint: str) -> str:
    info = model.info
    parts = [
        fingerprint,
        str(info.dtype),
        str(getattr(info, "format", "")),
        str(info.device),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        str(torch.get_num_threads()),
        kernels.source_tag(),  # the step runs our kernels: new kernels, new costs
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def monotone_envelope(costs: Sequence[float]) -> list[float]:
    """costs[n-1] lowered to min(costs[n-1:]): a forward of fewer tokens never costs more than
    one of more (it could be padded to that size), so a bump is noise the policy must not read
    (a slow moment at n = 6 once made 6 verified tokens dearer than 8)."""
    out = [float(c) for c in costs]
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def contexts_for(model, max_tokens: int) -> list[int]:
    """The committed-context lengths a step-cost profile is timed at: `CONTEXTS` that fit the
    model's positions (at least one, the largest that fits, for a model with a short window)."""
    room = model.info.max_position - max_tokens - 1
    fit = [c for c in CONTEXTS if c <= room]
    return fit or [max(min(CONTEXT, room), 1)]


@torch.inference_mode()
def measure_step_cost_curves(
    model, max_tokens: int, repeats: int = 5, contexts: Sequence[int] = (CONTEXT,)
) -> dict[int, list[float]]:
    """{context: median wall seconds of a forward of n = 1..max_tokens new tokens (batch 1) over
    that many committed tokens}. Every (context, n) is timed in turn within each repeat, so a slow
    stretch of a shared host lands on every size alike instead of on the few timed during it; a
    model that holds one slot (the transformers adapter) is timed one context after another."""
    ctxs = list(contexts)
    if model.info.max_slots is not None and model.info.max_slots < len(ctxs):
        out: dict[int, list[float]] = {}
        for ctx in ctxs:
            out |= measure_step_cost_curves(model, max_tokens, repeats, (ctx,))
        return out
    dev = model.info.device
    cache = model.new_cache(len(ctxs), max(ctxs) + max_tokens + 1)
    ids = torch.randint(0, model.info.vocab_size, (1, max(ctxs) + max_tokens), device=dev)
    for i, ctx in enumerate(ctxs):  # slot i holds a committed context of ctxs[i] tokens
        slot = torch.tensor([i], device=dev)
        model.forward(ids[:, :ctx], torch.arange(ctx, device=dev)[None], cache, slot)
        cache.commit(i, ctx)
    times = {ctx: [[] for _ in range(max_tokens)] for ctx in ctxs}
    for rep in range(repeats + 1):  # the first round is a warm-up
        for i, ctx in enumerate(ctxs):
            slot = torch.tensor([i], device=dev)
            for n in range(1, max_tokens + 1):
                x, pos = ids[:, ctx : ctx + n], torch.arange(ctx, ctx + n, device=dev)[None]
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                model.forward(x, pos, cache, slot)  # not committed: the next forward overwrites it
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if rep > 0:
                    times[ctx][n - 1].append(time.perf_counter() - t0)
    return {ctx: [statistics.median(t) for t in times[ctx]] for ctx in ctxs}


def measure_step_costs(model, max_tokens: int, repeats: int = 5) -> list[float]:
    """Median wall seconds of a forward of n = 1..max_tokens new tokens over a `CONTEXT`-token
    cache (batch 1; the model's window permitting)."""
    ctx = contexts_for(model, max_tokens)[0]
    return measure_step_cost_curves(model, max_tokens, repeats, (ctx,))[ctx]


def step_cost_curves(model, fingerprint: str, max_tokens: int) -> dict[int, list[float]]:
    """Cached `measure_step_cost_curves` at `contexts_for(model, max_tokens)`, each curve read
    through `monotone_envelope` (measured again when more tokens or other contexts are asked
    for, when the cached one was timed size after size (`order` missing), or when it was taken
    on a busy machine: `specdecode.measured`)."""
    ctxs = contexts_for(model, max_tokens)
    path = cache_dir() / "profiles" / f"{_key(model, fingerprint)}.json"

    def valid(old: dict) -> bool:
        curves = old.get("contexts")
        return (
            old.get("order") == "interleaved"
            and isinstance(curves, dict)
            and all(isinstance(curves.get(str(c)), list) and len(curves[str(c)]) >= max_tokens for c in ctxs)
        )

    rec = cached_measurement(
        path,
        lambda: {
            "contexts": {
                str(c): v for c, v in measure_step_cost_curves(model, max_tokens, contexts=ctxs).items()
            },
            "order": "interleaved",
            "dtype": str(model.info.dtype),
            "device": str(model.info.device),
        },
        valid=valid,
        cpu=model.info.device.type == "cpu",
    )
    return {c: monotone_envelope(rec["contexts"][str(c)])[:max_tokens] for c in ctxs}


def step_costs(model, fingerprint: str, max_tokens: int) -> list[float]:
    """The shortest measured context's curve of `step_cost_curves` (`CONTEXT` tokens where the
    model's window allows): `costs[n-1]` = seconds of a forward of n new tokens."""
    curves = step_cost_curves(model, fingerprint, max_tokens)
    return curves[min(curves)]


class RoundCosts(NamedTuple):
    """A drafting round's measured cost, in seconds."""

    fixed: float  # round(K) ~ fixed + K * per_token: the line through K = 1 and K = k
    per_token: float
    curve: list[float]  # round(K) for K = 1..k, piecewise linear through every measured K
    # What a sampled (T > 0) step costs beyond a greedy one with the same K (drafting q and
    # verification by rejection), minus what plain sampled decoding pays (K = 0): K = 0..k.
    sampled_extra: list[float] | None = None


SAMPLED_REPEATS = 8  # paired greedy / sampled timings per K (even: both orders alike)


def draft_round_costs(
    ident: Sequence[str],
    k: int,
    round_seconds: Callable[[int], float],
    cpu: bool = True,
    points: Sequence[int] = (),
    step_seconds: Callable[[int, float], float] | None = None,
) -> RoundCosts:
    """What a drafting round costs: (fixed, per token) and the curve over K = 1..k.

    `round_seconds(K)` times rounds that draft K tokens; it runs at K = 1, K = k and the
    drafter's own `points` (where its cost bends: an EAGLE-2 tree of K nodes grows min(K,
    depth) levels, so its cost rises up to K = depth and stays nearly flat after) once per
    `ident` (what the cost depends on: the drafter's architecture, the target, the machine),
    cached under `<cache_dir>/profiles/draft-*.json`, so later runs make the same decisions.
    `cpu=False`: the rounds run on a device, the host's share of the cores says nothing.
    `step_seconds(K, T)` (optional) times whole steps (drafting + verification) at K = 0 and the
    same K at T = 0 and T = 1, back to back: the median of their paired differences is
    `RoundCosts.sampled_extra` (module docstring).
    """
    at = sorted({1, k, *(p for p in points if 1 < p < k)})
    how = [f"sampled paired x{SAMPLED_REPEATS}"] if step_seconds is not None else []
    key = hashlib.sha256("|".join([*ident, ",".join(map(str, at)), *how]).encode()).hexdigest()[:24]

    def measure() -> dict:
        rounds = {str(n): round_seconds(n) for n in at}
        one, full = rounds["1"], rounds[str(k)]
        per_token = max((full - one) / (k - 1), 0.0) if k > 1 else one
        fixed = max(one - per_token, 0.0)
        rec = {"fixed_s": fixed, "per_token_s": per_token, "rounds_s": rounds}
        if step_seconds is not None:  # greedy and sampled steps back to back, per K, repeated
            diffs: dict[int, list[float]] = {n: [] for n in (0, *at)}
            for r in range(SAMPLED_REPEATS):
                for n, d in diffs.items():
                    first, second = (0.0, 1.0) if r % 2 == 0 else (1.0, 0.0)
                    times = {first: step_seconds(n, first), second: step_seconds(n, second)}
                    d.append(times[1.0] - times[0.0])
            # each greedy-first pair averaged with the sampled-first pair after it, so that a
            # first (or second) run of a pair being faster cancels out; then the median
            rec["sampled_extra_s"] = {
                str(n): statistics.median((a + b) / 2 for a, b in zip(d[::2], d[1::2], strict=True))
                for n, d in diffs.items()
            }
        return rec

    sampled = step_seconds is not None
    rec = cached_measurement(
        cache_dir() / "profiles" / f"draft-{key}{'-sampled' if sampled else ''}.json",
        measure,
        valid=lambda old: (
            "fixed_s" in old
            and "per_token_s" in old
            and "rounds_s" in old
            and (not sampled or "sampled_extra_s" in old)
        ),
        cpu=cpu,
    )
    xs = sorted(int(n) for n in rec["rounds_s"])  # holds 1 and k: no K of the curve lies outside
    curve = [interp(xs, [rec["rounds_s"][str(n)] for n in xs], K) for K in range(1, k + 1)]
    extra = None
    if sampled:
        ex = {int(n): t for n, t in rec["sampled_extra_s"].items()}
        ks = sorted(ex)
        # Beyond plain sampled decoding's own cost; noise never makes drafting cheaper.
        # (ks hold 0 and k: np.interp, unlike `interp`, keeps a negative difference negative)
        extra = [max(float(np.interp(K, ks, [ex[n] for n in ks])) - ex[0], 0.0) for K in range(k + 1)]
        extra = monotone_envelope(extra)  # drafting more at T > 0 never costs less
    return RoundCosts(rec["fixed_s"], rec["per_token_s"], curve, extra)


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extrapolated linearly past both ends (xs ascending)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.inference_mode()
def measure_batch_costs(
    model,
    rows: Sequence[int],
    blocks: Sequence[int],
    contexts: Sequence[int],
    min_time: float = 0.02,
    passes: int = 3,
) -> list[list[list[float]]]:
    """times[c][r][b]: wall seconds of a forward of [rows[r], blocks[b]] tokens at contexts[c].

    Each point is the fastest of its runs: `passes` sweeps over the whole grid (so a burst of
    other work on a shared machine cannot skew one region of it), each run repeated until
    `min_time` has passed, after one warm-up at the largest shape. The minimum is the stable
    statistic on a shared machine.
    """
    num_rows, max_block, max_ctx = max(rows), max(blocks), max(contexts)
    cache = model.new_cache(num_rows, max_ctx + max_block + 1)
    dev = model.info.device
    ids = torch.randint(0, model.info.vocab_size, (num_rows, max_ctx + max_block), device=dev)
    # The K/V values do not change the timing: prefill one slot and copy it to the others.
    fill = num_rows if not hasattr(cache, "kv") else 1
    for s in range(fill):
        for c0 in range(0, max_ctx, 512):
            c1 = min(max_ctx, c0 + 512)
            model.forward(ids[s : s + 1, c0:c1], torch.arange(c0, c1, device=dev)[None], cache, [s])
            cache.commit(s, c1 - c0)
    if fill == 1 and num_rows > 1:
        cache.kv[:, :, 1:num_rows] = cache.kv[:, :, :1]
    slots = list(range(num_rows))

    def run(n_rows: int, block: int, ctx: int) -> float:
        for s in slots:
            cache.lengths[s] = ctx  # forward never commits, so lengths stay put between runs
        x = ids[:n_rows, ctx : ctx + block]
        pos = torch.arange(ctx, ctx + block, device=dev)[None].expand(n_rows, block)
        _sync(dev)
        t0 = time.perf_counter()
        model.forward(x, pos, cache, slots[:n_rows])
        _sync(dev)
        return time.perf_counter() - t0

    run(num_rows, max_block, max_ctx)  # warm-up
    times = [[[float("inf")] * len(blocks) for _ in rows] for _ in contexts]
    for _ in range(passes):
        for c, ctx in enumerate(contexts):
            for r, n_rows in enumerate(rows):
                for b, block in enumerate(blocks):
                    spent, n = 0.0, 0
                    while n < 1 or (spent < min_time and n < 4):
                        t = run(n_rows, block, ctx)
                        times[c][r][b] = min(times[c][r][b], t)
                        spent, n = spent + t, n + 1
    return times


def batch_step_costs(
    model, fingerprint: str, rows: Sequence[int], blocks: Sequence[int], contexts: Sequence[int]
) -> list[list[list[float]]]:
    """Cached `measure_batch_costs` for this grid."""
    grid = f"v2|rows={list(rows)}|blocks={list(blocks)}|contexts={list(contexts)}"
    key = hashlib.sha256(f"{_key(model, fingerprint)}|{grid}".encode()).hexdigest()[:24]
    path = cache_dir() / "profiles" / f"batch-{key}.json"
    rec = cached_measurement(
        path,
        lambda: {
            "grid": grid,
            "times": measure_batch_costs(model, rows, blocks, contexts),
            "dtype": str(model.info.dtype),
        },
        valid=lambda old: old.get("grid") == grid and "times" in old,
        cpu=model.info.device.type == "cpu",
    )
    return rec["times"]
