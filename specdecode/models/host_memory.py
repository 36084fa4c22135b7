"""The C heap under a CPU decode step: keep freed buffers for the next step instead of
handing them back to the OS and faulting them in again.

Contract:
* `keep_freed_memory()` sets glibc's malloc so that buffers of up to 32 MiB (its largest
  allowed mmap threshold) come from the heap, and freed heap memory is returned to the OS only
  past 1 GiB at the top of the heap. A batched step allocates and frees the same large buffers
  every step (64 rows of 49,152 logits are 12.6 MB, each of softmax, cumsum, the temperature
  division...); with glibc's defaults they are mmapped or trimmed on free and every page of
  them is faulted in again the next step (1.8 M minor faults in a 64-row regeneration of
  7.5 k tokens, 0.43 M with this). The process keeps its peak heap instead (what jemalloc
  or tcmalloc do too); `release_freed_memory()` still hands it back on demand. Called once
  by the loader for a model on the CPU; idempotent; does nothing without glibc, or when
  `SPECDECODE_MALLOC=default` (glibc's own settings, e.g. to compare).
* `release_freed_memory()` hands freed heap memory back to the OS now (`malloc_trim(0)`), after
  a one-off peak such as converting every weight to another format.
* `huge_page_empty(shape, dtype)` is `torch.empty` on the CPU whose pages the kernel is asked to
  back with 2 MiB pages (`madvise(MADV_HUGEPAGE)` on the whole 2 MiB blocks inside it), for a
  large buffer read in long strided runs every step: a batched step's KV cache (64 requests'
  keys and values lie megabytes apart, and every 4 KiB page of them costs a TLB walk). Buffers
  over the mmap threshold (32 MiB) are fresh mappings, so every page faults in huge; smaller ones
  may reuse heap pages already touched (those stay as they are), and under 4 MiB nothing is
  advised. Where the system's transparent huge pages are `never`, or without glibc, it is plain
  `torch.empty`; the contents are uninitialised either way.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

MMAP_THRESHOLD = 32 << 20  # glibc's maximum: allocations above it are always mmapped
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)
_MADV_HUGEPAGE = 14  # madvise advice number (linux/mman.h)
HUGE_PAGE = 2 << 20


@cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 (glibc only: raises AttributeError elsewhere)
        return libc
    except (OSError, AttributeError):
        return None


@cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc for per-step buffers (see module docstring); True when it was set."""
    libc = _libc()
    if libc is None or os.environ.get("SPECDECODE_MALLOC") == "default":
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps large freed blocks otherwise)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype)` on the CPU, backed by huge pages where the OS allows (docstring)."""
    t = torch.empty(shape, dtype=dtype, device="cpu")
    libc = _libc()
    if libc is None or t.numel() * t.element_size() < 2 * HUGE_PAGE:
        return t
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the buffer
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return t
