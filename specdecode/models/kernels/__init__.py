"""Compiled CPU kernels of our own, built on first use; kernels that cannot be built are absent.

Contract:
- `fused()` returns `torch.ops.specdecode`, or None. It holds
  - the bf16-weight product of `bf16w.cpp`: `bf16w_pack(w [N, K] bf16) -> packed` once, then
    `bf16w_linear(x [M, K] fp32, packed, N, bias [N] | None) -> [M, N] fp32` (x @ w.T + bias
    in fp32 arithmetic), and its int8 twin `int8w_pack(q [N, K] int8, scale [N])` /
    `int8w_linear(x, packed, N, bias | None)` (x @ (q * scale).T + bias in fp32 arithmetic);
  - the AMX product of `amx.cpp`: `bf16amx_pack(w [N, K] bf16)` once (raises where the CPU or
    the OS gives no AMX tiles), then `bf16amx_linear(x [M, K] fp32, packed, N, bias | None)`
    (x rounded to bf16, bf16 x bf16 products accumulated in fp32);
  - the AVX512-BF16 product of `bf16dp.cpp`: `bf16dp_pack(w [N, K] bf16)` once (raises on a
    CPU without AVX512-BF16), then `bf16dp_linear(x [M, K] fp32, packed, N, bias | None)`
    (the AMX product's arithmetic on vector dot-product instructions, in a layout of its own),
    and `bf16dp1_linear`, the same on the same packing, up to 16 rows read as one stream;
  - the fused fp32 layer ops of `fused.cpp` (`rms_norm`, `add_rms_norm`, `rope_`, `silu_mul`,
    `attention`; contracts in that file), DSpark's Markov passes `markov_argmax` and
    `markov_sample`, and `markov_topk` (a DSpark tree node's children);
    `attention_avx512(on)` switches attention's value pass between AVX-512 and 8 lanes (the
    same result bit for bit; chosen by timing both when the extension loads, `choices`), and
    `bf16w_streams(n)` a one-row `bf16w` product between 2 and 3 blocks read side by side
    (the same result; the faster timed once per machine and cached, `choices`);
  - `decode_layer` of `layer.cpp`: a whole decoder layer of the native runtime in one call
    (those ops and our products, called directly, in the Python path's order; contract there),
    `decode_layers` (every layer of a forward: decode_layer a layer, looped in C++; a drafter's
    block with its per-head q/k norms too), `context_rows` (a DFlash/DSpark catch-up: fusion,
    key/value product, key norms, RoPE, cache writes), `markov_draft` (a DSpark round's head,
    Markov chain, greedy or sampled, and confidences) and `head_rows` (a DFlash round's head and
    every slot's argmax or draw),
    and `eagle_chain`, EAGLE-3's greedy draft chain of one request in one call
    (`eagle_chain_sampled`: drawn at a temperature from given uniforms, with the distributions),
    `mtp_module` (an MTP module's input product and block over its new rows) and `head_draft`
    (one draft from one state: norm, head product, argmax or a draw at a plain temperature);
  - `row_argmax` and `verify_chain` of `verify.cpp`: a step's chain verification over the
    target's logits (greedy, or plain temperature by rejection or sample-then-match) without
    building vocabulary-sized distributions (`specdecode.verify_native`; contract there).
  Each computes a row the same way whatever the number of rows.
- Both come from one extension, absent when it cannot run here: a non-x86 CPU, no C++
  compiler, a failed build, or a CPU without AVX2 + FMA (that check only keeps the process
  from an illegal instruction; whether a kernel is *used* is decided by timing it,
  `models.formats`). The reason is kept in `unavailable["cpu"]`.
- Built by torch's JIT extension builder (ninja) into torch's extension directory
  (`$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`), under a name holding the
  sources' hash and the torch version; the first build takes about a minute, later loads are
  instant.
- `SPECDECODE_NO_KERNELS=1` disables them (e.g. to compare against stock PyTorch).
- `barred(pack)`: the AMX and AVX512-BF16 products need more than AVX2 + FMA; where PyTorch's own
  kernels are capped below AVX-512 (`ATEN_CPU_CAPABILITY=avx2`, with ONEDNN_MAX_CPU_ISA and
  MKL_ENABLE_INSTRUCTIONS the way to run the AVX2 kind's kernels on a bigger CPU) ours are
  capped alike: `models.formats` treats a barred kernel as refused here. A cap, not a CPU flag:
  on an uncapped CPU only timing decides.
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import time
from functools import cache
from pathlib import Path

import torch

from specdecode.assets import cache_dir
from specdecode.measured import cached_measurement, cpu_model

HERE = Path(__file__).parent
SOURCES = ("bf16w.cpp", "fused.cpp", "amx.cpp", "bf16dp.cpp", "layer.cpp", "verify.cpp")
HEADERS = ("bf16_pairs.h", "products.h", "vec_math.h")  # included by the kernels
unavailable: dict[str, str] = {}
choices: dict[str, str] = {}  # kernel variants picked by timing here (`_choose_value_pass`)


def _cpu_runs_avx2_fma() -> bool:
    # Safety only (an AVX2 instruction on an older CPU kills the process); not a format choice.
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


@cache
def source_tag() -> str:
    """Hash of the kernels' sources (read once a process): part of every cache key that timed them."""
    return hashlib.sha256(b"".join((HERE / s).read_bytes() for s in SOURCES + HEADERS)).hexdigest()[:12]


@cache
def _ops():
    """torch.ops.specdecode once the extension is loaded, else None (reason in `unavailable`)."""
    if os.environ.get("SPECDECODE_NO_KERNELS"):
        unavailable["cpu"] = "SPECDECODE_NO_KERNELS is set"
        return None
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_runs_avx2_fma():
        unavailable["cpu"] = "needs an x86-64 CPU with AVX2 and FMA"
        return None
    srcs = [HERE / s for s in SOURCES]
    tag = source_tag()
    try:
        from torch.utils.cpp_extension import load

        # torch's extension directory is shared by every environment of one Python version:
        # the torch version in the name keeps two environments from loading each other's build
        torch_tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
        load(
            name=f"specdecode_cpu_{tag}_torch{torch_tag}",
            sources=[str(p) for p in srcs],
            # OpenMP pragmas (at::parallel_for) compiled in, but no OpenMP runtime linked: the
            # symbols resolve to the one torch already loaded, so both share one thread pool
            # (a second runtime's spinning threads would fight torch's for the cores).
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            verbose=False,
        )
        unavailable.pop("cpu", None)
        _choose_value_pass(torch.ops.specdecode)
        _choose_one_row_streams(torch.ops.specdecode)
        return torch.ops.specdecode
    except Exception as e:  # no compiler, no ninja, a failed build: the kernels are just absent
        unavailable["cpu"] = f"could not build {', '.join(SOURCES)}: {type(e).__name__}: {str(e)[:300]}"
        return None


_AVX512_PACKS = ("bf16amx_pack", "bf16dp_pack")  # products beyond the extension's AVX2 + FMA


def capped_isa() -> str | None:
    """PyTorch's CPU capability when it is capped below AVX-512 (ATEN_CPU_CAPABILITY), else None."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if os.environ.get("ATEN_CPU_CAPABILITY") and cap in ("DEFAULT", "AVX2") else None


def barred(pack: str) -> str | None:
    """Why the product packed by `pack` may not run in this process (see docstring), or None."""
    cap = capped_isa()
    if cap is not None and pack in _AVX512_PACKS:
        return f"{pack}'s kernel needs AVX-512; PyTorch's CPU capability is capped to {cap}"
    return None


def _choose_value_pass(ops) -> None:
    """Attention's value pass on AVX-512 or on 8 lanes (the same result bit for bit, see
    fused.cpp): AVX-512 where the CPU runs it, PyTorch is not capped below it, and a verify-sized
    block (24 rows over 264 keys, 3 KV heads) runs faster with it. Recorded in `choices`."""
    if capped_isa() is not None:
        ops.attention_avx512(False)
        choices["attention"] = f"8 lanes (PyTorch capped to {capped_isa()})"
        return
    if not ops.attention_avx512(True):
        choices["attention"] = "8 lanes (no AVX-512F here)"
        return
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 24, 64, generator=gen)  # [B, Hk, G*N, D]: 8 tokens of a 3:1 GQA model
    k, v = torch.randn(2, 1, 3, 264, 64, generator=gen)  # [B, Hk, L, D] each
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(18):
        for on in (False, True):
            ops.attention_avx512(on)
            t0 = time.perf_counter()
            ops.attention(q, k, v, None)
            if rep >= 3:  # warm-up
                times[on].append(time.perf_counter() - t0)
    off_us, on_us = (statistics.median(times[x]) * 1e6 for x in (False, True))
    ops.attention_avx512(on_us <= off_us)
    choices["attention"] = f"{'AVX-512' if on_us <= off_us else '8 lanes'} ({on_us:.0f} vs {off_us:.0f} us)"


def _choose_one_row_streams(ops) -> None:
    """How many blocks a one-row `bf16w` product reads side by side, 2 or 3 (the same outputs bit
    for bit, see bf16w.cpp): the faster of both timed on this machine once (`_time_streams`),
    cached like the format plans (`measured.cached_measurement`: measured again after a busy
    first try, or when the record holds no stream count) under torch's version, the CPU, the
    threads and these sources. In `choices`."""
    ident = "|".join((torch.__version__, cpu_model(), str(torch.get_num_threads()), source_tag()))
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    path = cache_dir() / "kernels" / f"bf16w-streams-{key}.json"
    try:
        rec = cached_measurement(path, lambda: _time_streams(ops), valid=lambda r: r.get("streams") in (2, 3))
    except OSError:  # no writable cache directory: timed for this process alone
        rec = _time_streams(ops)
    ops.bf16w_streams(rec["streams"])
    us = rec["us"]
    choices["bf16w one row"] = f"{rec['streams']} streams ({us['3']:.0f} vs {us['2']:.0f} us for 3 and 2)"


def _time_streams(ops) -> dict:
    """One-row products of 16 layers of a small model's shapes (72 MiB of weights, past the L3
    caches as a step's are) with 2 and 3 streams, alternately: the faster, and both medians."""
    shapes = [(1024, 512), (512, 512), (2048, 512), (512, 1024)] * 16  # a layer's products, [N, K]
    packed = [
        (ops.bf16w_pack(torch.full(s, 0.01, dtype=torch.bfloat16)), s[0], torch.ones(1, s[1])) for s in shapes
    ]
    times: dict[int, list[float]] = {2: [], 3: []}
    for rep in range(33):
        for streams in (2, 3) if rep % 2 else (3, 2):
            ops.bf16w_streams(streams)
            t0 = time.perf_counter()
            for p, n, x in packed:
                ops.bf16w_linear(x, p, n, None)
            if rep >= 2:  # warm-up
                times[streams].append(time.perf_counter() - t0)
    us = {str(s): statistics.median(times[s]) * 1e6 for s in (2, 3)}
    return {"streams": 3 if us["3"] < us["2"] else 2, "us": us}


def fused():
    """Our ops (see module docstring), or None."""
    return _ops()
