"""Step-cost profiles: how long one forward of N new tokens takes on this machine.

Contract: `step_costs(model, max_tokens)` returns `costs[n-1]` = median seconds of a forward of
n new tokens (n = 1..max_tokens) over a 256-token context, batch 1. Profiles are cached as
JSON under `<cache_dir>/profiles/`, keyed by the model's fingerprint, dtype, device, torch
version, CPU capability and thread count, so a machine measures once and later runs make the
same draft-length decisions (a seeded sampled run stays reproducible).

Why: whether verifying K extra tokens is nearly free depends on the hardware. With AMX (or a
GPU) a bf16 forward of 8 tokens costs about one of 1 token; on an AVX2-only CPU it costs ~5x.
The adaptive draft-length policy reads these costs instead of assuming either.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time

import torch

CONTEXT = 256


def _key(model, fingerprint: str) -> str:
    info = model.info
    parts = [
        fingerprint,
        str(info.dtype),
        str(info.device),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        str(torch.get_num_threads()),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


@torch.inference_mode()
def measure_step_costs(model, max_tokens: int, repeats: int = 5) -> list[float]:
    """Median wall seconds of a forward of n = 1..max_tokens new tokens (batch 1)."""
    ctx = min(CONTEXT, model.info.max_position - max_tokens - 1)
    cache = model.new_cache(1, ctx + max_tokens + 1)
    dev = model.info.device
    slots = torch.tensor([0], device=dev)
    ids = torch.randint(0, model.info.vocab_size, (1, ctx + max_tokens), device=dev)
    model.forward(ids[:, :ctx], torch.arange(ctx, device=dev)[None], cache, slots)
    cache.commit(0, ctx)
    costs = []
    for n in range(1, max_tokens + 1):
        x, pos = ids[:, ctx : ctx + n], torch.arange(ctx, ctx + n, device=dev)[None]
        times = []
        for _ in range(repeats + 1):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            model.forward(x, pos, cache, slots)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        costs.append(statistics.median(times[1:]))  # first run is a warm-up
    return costs


def step_costs(model, fingerprint: str, max_tokens: int) -> list[float]:
    """Cached `measure_step_costs` (re-measured when more tokens are asked for)."""
    from specdecode.assets import cache_dir

    path = cache_dir() / "profiles" / f"{_key(model, fingerprint)}.json"
    try:
        costs = json.loads(path.read_text())["costs"]
        if len(costs) >= max_tokens:
            return costs[:max_tokens]
    except (OSError, ValueError, KeyError):
        pass
    costs = measure_step_costs(model, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(
        json.dumps({"costs": costs, "dtype": str(model.info.dtype), "device": str(model.info.device)})
    )
    os.replace(tmp, path)
    return costs
