"""models/host_memory: freed per-step buffers stay in the heap (fewer page faults), on demand."""

import json
import os
import subprocess
import sys

import pytest

from specdecode.models import host_memory

# A decode step's allocation pattern in miniature: buffers of 12.6 MB (64 rows of a 49,152-id
# vocabulary) and 8 MB made and freed in an order that leaves the heap's top free between steps.
_CHILD = """
import json, resource, torch
from specdecode.models.host_memory import keep_freed_memory
tuned = keep_freed_memory()
def step():
    a = torch.ones(64, 49152); b = torch.ones(64, 49152)
    c = a.cumsum(-1); del a
    d = torch.ones(256, 8192); del b, c, d
step()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0}))
"""


def _child(env_value: str | None) -> dict:
    env = {"SPECDECODE_MALLOC": env_value} if env_value else {}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._libc() is None, reason="needs glibc")
def test_kept_heap_faults_fewer_pages_than_glibc_defaults():
    tuned, default = _child(None), _child("default")
    assert tuned["tuned"] is True and default["tuned"] is False
    # each step touches ~36 MB (8,800 pages) of fresh buffers; kept memory is reused
    assert tuned["faults"] * 2 < default["faults"], (tuned, default)


def _anon_huge_kb() -> int:
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def test_huge_page_empty_is_empty_of_that_shape_and_dtype():
    import torch

    t = host_memory.huge_page_empty((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()


@pytest.mark.skipif(
    host_memory._libc() is None or _thp_mode() != "madvise" or not os.path.exists("/proc/self/smaps_rollup"),
    reason="needs glibc and transparent huge pages in madvise mode (only advised memory gets them)",
)
def test_huge_page_empty_is_backed_by_huge_pages_when_advised():
    import torch

    before = _anon_huge_kb()
    t = host_memory.huge_page_empty((64, 2 << 20), torch.uint8)  # 128 MiB
    t.fill_(1)  # touch every page
    gained = _anon_huge_kb() - before
    # the kernel may decline some blocks (fragmentation); most of them come in 2 MiB pages
    assert gained >= 64 * 1024, gained
    assert int(t[-1, -1]) == 1
