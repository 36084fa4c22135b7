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


def _vm_flags_at(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `addr` (/proc/self/smaps)."""
    inside, flags = False, []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


def test_huge_page_empty_is_empty_of_that_shape_and_dtype():
    import torch

    t = host_memory.huge_page_empty((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()


@pytest.mark.skipif(
    host_memory._libc() is None
    or not os.path.exists("/proc/self/smaps")
    or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
    reason="needs glibc, /proc/self/smaps and a kernel with transparent huge pages",
)
def test_huge_page_empty_advises_its_whole_huge_pages():
    """The kernel records the advice on the mapping (VmFlags `hg`) whether or not it finds free
    huge pages at fault time, so the test reads the advice, not the pages the system gave."""
    import torch

    t = host_memory.huge_page_empty((64, 2 << 20), torch.uint8)  # 128 MiB: a fresh mapping
    first = -(-t.data_ptr() // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE
    assert "hg" in _vm_flags_at(first)
    t.fill_(1)
    assert int(t[-1, -1]) == 1
