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
