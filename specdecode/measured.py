"""Machine measurements cached as JSON, measured again when they were taken on a busy machine.

Contract: `cached_measurement(path, measure, valid=None, cpu=True)` returns the record at `path`
when it is final, else runs `measure()` (a JSON-able dict), stamps it with `cpu_share` (CPU time
of this process / (wall time x torch threads) while it ran), `load_average` and `attempts`,
keeps the quieter of the old and the new record, writes it atomically and returns it. A record
is final when it was measured quietly (`cpu_share >= QUIET_SHARE`) or `MAX_ATTEMPTS` times; one
without `cpu_share` (written before the rule) counts as a busy first attempt. `valid(rec)` says
whether an old record answers the question at all (e.g. costs for enough tokens); one that does
not is measured anew from the first attempt. `cpu=False` (a GPU measurement, where the host
waits) stamps a share of 1.0: the rule is about CPU cores shared with other work.
`run_with_share(fn)` is that timing alone; `read_record` / `write_record` are the plain JSON
reads and atomic writes; `cpu_model()` names the CPU for the cache keys.

Why: format plans, step costs and drafting-round costs are measured once per machine and then
steer every later run (which kernel, which K). One taken while a training job or a test suite
shared the two cores would steer them wrong for good; the share of the cores our threads got
tells such a measurement apart without reading any other process.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

QUIET_SHARE = 0.8  # CPU time / (wall x threads) while measuring; below, other work took the cores
MAX_ATTEMPTS = 3  # a record measured on a busy machine is measured again at the next uses, this often


def read_record(path: Path) -> dict:
    """A cached record, or {} when it is missing or unreadable."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def write_record(path: Path, rec: dict) -> None:
    """Write a record atomically (concurrent processes may measure the same thing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, path)


def run_with_share(fn: Callable[[], dict]) -> tuple[dict, float]:
    """fn's result and the share of the cores this process's threads got while it ran."""
    wall, clock = time.perf_counter(), time.process_time()
    out = fn()
    wall = max(time.perf_counter() - wall, 1e-9)
    return out, (time.process_time() - clock) / (wall * torch.get_num_threads())


def cpu_model() -> str:
    """This CPU's model name (part of every cache key of a measurement), or "unknown"."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def is_final(rec: dict) -> bool:
    return rec.get("cpu_share", 0.0) >= QUIET_SHARE or rec.get("attempts", 1) >= MAX_ATTEMPTS


def cached_measurement(
    path: Path, measure: Callable[[], dict], valid: Callable[[dict], bool] | None = None, cpu: bool = True
) -> dict:
    old = read_record(path)
    if old and valid is not None and not valid(old):
        old = {}
    if old and is_final(old):
        return old
    rec, share = run_with_share(measure) if cpu else (measure(), 1.0)
    rec = {
        **rec,
        "load_average": os.getloadavg()[0],  # other work running while this was measured
        "cpu_share": round(share, 3),  # of the cores our threads got while measuring
        "attempts": old.get("attempts", 1) + 1 if old else 1,
    }
    if old and old.get("cpu_share", 0.0) > rec["cpu_share"]:  # the quieter one stays
        rec = {**old, "attempts": rec["attempts"]}
    write_record(path, rec)
    return rec
