"""Compiled CPU kernels of our own, built on first use; a kernel that cannot be built is absent.

Contract:
- `bf16w()` builds and loads `bf16w.cpp` and returns its op,
  `torch.ops.specdecode.bf16w_linear(x [M, K] fp32, w [N, K] bf16 contiguous, bias [N] | None)
  -> [M, N] fp32` (x @ w.T + bias), or None when it cannot run here: a non-x86
  CPU, no C++ compiler, a failed build, or a CPU without AVX2 + FMA (the last check only keeps
  the process from an illegal instruction; whether the kernel is *used* is decided by timing it,
  `models.formats`). The reason it is absent is kept in `unavailable["bf16w"]`.
- Built by torch's JIT extension builder (ninja) into torch's extension directory
  (`$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`), under a name holding the
  source's hash; the first build takes about a minute, later loads are instant.
- `SPECDECODE_NO_KERNELS=1` disables them all (e.g. to compare against stock PyTorch).
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import cache
from pathlib import Path

import torch

HERE = Path(__file__).parent
unavailable: dict[str, str] = {}


def _cpu_runs_avx2_fma() -> bool:
    # Safety only (an AVX2 instruction on an older CPU kills the process); not a format choice.
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


@cache
def bf16w():
    """The bf16-weight fp32 product op (see module docstring), or None."""
    if os.environ.get("SPECDECODE_NO_KERNELS"):
        unavailable["bf16w"] = "SPECDECODE_NO_KERNELS is set"
        return None
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_runs_avx2_fma():
        unavailable["bf16w"] = "needs an x86-64 CPU with AVX2 and FMA"
        return None
    src = HERE / "bf16w.cpp"
    tag = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load

        load(
            name=f"specdecode_bf16w_{tag}",
            sources=[str(src)],
            # OpenMP pragmas (at::parallel_for) compiled in, but no OpenMP runtime linked: the
            # symbols resolve to the one torch already loaded, so both share one thread pool
            # (a second runtime's spinning threads would fight torch's for the cores).
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            verbose=False,
        )
        return torch.ops.specdecode.bf16w_linear
    except Exception as e:  # no compiler, no ninja, a failed build: the kernel is just absent
        unavailable["bf16w"] = f"could not build bf16w.cpp: {type(e).__name__}: {str(e)[:300]}"
        return None
