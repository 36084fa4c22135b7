"""The hardware limit of decoding: memory bandwidth and the tokens/s ceiling it implies.

Contract: `measure_read_bandwidth()` returns bytes/s reading a buffer far larger than the
caches (median of repeats, with the process's torch threads). `weight_bytes(model)` counts the
bytes one decoding step must stream (the native runtime: the weight copies its one-token kernels
read; other models: every parameter once, in its stored dtype).
`ar_ceiling(model, bandwidth)` = bandwidth / weight_bytes: the most tokens/s plain batch-1
decoding can reach on this machine, since each step reads all weights at least once.
`machine_info()` names the CPU/GPU, its bf16 support and the library versions for reports; under
a cap of PyTorch's CPU capability (the AVX2 kind emulated, `kernels.barred`) its bf16 entry says so.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
import statistics
import time

import torch

from specdecode.models import kernels
from specdecode.models.native import NativeDecoder

# the variables that emulate the AVX2 kind on a bigger CPU (shared ASSETS)
_ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def measure_read_bandwidth(
    num_bytes: int = 1 << 30, repeats: int = 5, device: str | torch.device = "cpu"
) -> float:
    """Bytes per second for a full read of a `num_bytes` fp32 buffer (sum reduction)."""
    dev = torch.device(device)
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=dev)
    times = []
    for _ in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        x.sum()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    del x
    return num_bytes / statistics.median(times[1:])


def weight_bytes(model) -> int:
    if isinstance(model, NativeDecoder):  # the copies its one-token kernels read, not the masters
        return model.step_weight_bytes()
    params = getattr(model, "parameters", None)
    if params is None:
        return 0
    seen, total = set(), 0
    for p in params():
        if p.data_ptr() in seen:  # tied embeddings count once
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def ar_ceiling(model, bandwidth: float) -> float:
    """Tokens/s upper bound for batch-1 decoding: every step streams all weights once."""
    nbytes = weight_bytes(model)
    return bandwidth / nbytes if nbytes else float("nan")


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:  # the installed version, without importing transformers
        info["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        pass
    try:
        text = open("/proc/cpuinfo").read()
        info["cpu"] = next(
            ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")
        )
        info["bf16_gemm"] = (
            "AMX" if "amx_bf16" in text else "AVX512-BF16" if "avx512_bf16" in text else "none"
        )
        cap = kernels.capped_isa()
        if cap is not None:  # the AVX2 kind emulated: say so wherever the machine is named
            env = " ".join(f"{k}={os.environ[k]}" for k in _ISA_CAPS if k in os.environ)
            info["bf16_gemm"] = f"none: kernels capped to {cap} ({env}) on a CPU with {info['bf16_gemm']}"
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or platform.machine()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
