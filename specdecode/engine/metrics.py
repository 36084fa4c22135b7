"""Serving metrics in the Prometheus text exposition format (version 0.0.4), without dependencies.

Contract: `Metrics` is a thread-safe registry of counters, gauges and histograms declared in
`METRICS` (name -> type, help, histogram buckets). `inc`, `set` and `observe` update a series
(labels as keyword arguments); `gauge_fn` registers a gauge read at scrape time; `render()`
returns the text a Prometheus server scrapes from `/metrics`; `value()` reads one series back
(tests, benchmark reports). Names follow Prometheus conventions: `_total` for counters,
`_seconds` for durations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# name -> (type, help, buckets)
METRICS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "specdecode_requests_total": (
        "counter",
        "Requests finished, by outcome (stop, length, cancelled, error).",
        (),
    ),
    "specdecode_request_errors_total": (
        "counter",
        "Requests refused or failed, by HTTP status and kind.",
        (),
    ),
    "specdecode_prompt_tokens_total": ("counter", "Prompt tokens of admitted requests.", ()),
    "specdecode_generation_tokens_total": ("counter", "Tokens generated (streamed to clients).", ()),
    "specdecode_steps_total": ("counter", "Decode steps (one target forward each).", ()),
    "specdecode_verify_rows_total": ("counter", "Request-steps verified (one per request per step).", ()),
    "specdecode_emitted_tokens_total": ("counter", "Tokens emitted by verification (accepted + 1).", ()),
    "specdecode_draft_tokens_total": ("counter", "Draft tokens verified.", ()),
    "specdecode_accepted_tokens_total": ("counter", "Draft tokens accepted.", ()),
    "specdecode_prefill_tokens_total": ("counter", "Prompt tokens prefilled.", ()),
    "specdecode_tau": ("gauge", "Tokens per verification step per request (emitted / verify rows).", ()),
    "specdecode_acceptance_rate": ("gauge", "Accepted / verified draft tokens.", ()),
    "specdecode_queue_depth": ("gauge", "Requests waiting for a slot.", ()),
    "specdecode_running_requests": ("gauge", "Requests holding a slot.", ()),
    "specdecode_free_slots": ("gauge", "Free cache slots.", ()),
    "specdecode_step_seconds": ("histogram", "Wall time of one engine step (prefill + decode).", _LATENCY),
    "specdecode_step_batch_tokens": ("histogram", "Tokens per verify forward (rows x block).", _COUNT),
    "specdecode_time_to_first_token_seconds": ("histogram", "Submit to first streamed token.", _LATENCY),
    "specdecode_request_latency_seconds": ("histogram", "Submit to finish.", _LATENCY),
}


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(labels: tuple[tuple[str, str], ...], extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    esc = [(k, str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for k, v in items]
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = {n: {} for n in METRICS}
        self._hist: dict[str, dict[tuple, list[float]]] = {
            n: {} for n, m in METRICS.items() if m[0] == "histogram"
        }
        self._fns: dict[str, Callable[[], float]] = {}

    @staticmethod
    def _key(labels: dict) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in labels.items()))

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[name][self._key(labels)] = float(value)

    def gauge_fn(self, name: str, fn: Callable[[], float]) -> None:
        self._fns[name] = fn

    def observe(self, name: str, value: float, **labels) -> None:
        buckets = METRICS[name][2]
        key = self._key(labels)
        with self._lock:
            h = self._hist[name].setdefault(key, [0.0] * (len(buckets) + 2))  # buckets, +Inf, sum
            for i, b in enumerate(buckets):
                if value <= b:
                    h[i] += 1
            h[len(buckets)] += 1
            h[len(buckets) + 1] += value

    def value(self, name: str, **labels) -> float:
        """A counter or gauge series (0 if never set); a histogram's count."""
        if name in self._fns:
            return float(self._fns[name]())
        key = self._key(labels)
        with self._lock:
            if name in self._hist:
                h = self._hist[name].get(key)
                return h[-2] if h else 0.0
            return self._values[name].get(key, 0.0)

    def total(self, name: str) -> float:
        """Sum of a counter over all its label sets."""
        with self._lock:
            return sum(self._values[name].values())

    def render(self) -> str:
        lines = []
        fn_values = {}
        for name, fn in self._fns.items():
            try:
                fn_values[name] = float(fn())
            except Exception:  # a broken callback must not break the scrape
                fn_values[name] = float("nan")
        with self._lock:
            for name, (kind, help_text, buckets) in METRICS.items():
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                if name in fn_values:
                    lines.append(f"{name} {_fmt(fn_values[name])}")
                    continue
                if kind == "histogram":
                    for key, h in sorted(self._hist[name].items()):
                        for i, b in enumerate(buckets):
                            lines.append(f"{name}_bucket{_labels(key, (('le', _fmt(b)),))} {_fmt(h[i])}")
                        lines.append(
                            f"{name}_bucket{_labels(key, (('le', '+Inf'),))} {_fmt(h[len(buckets)])}"
                        )
                        lines.append(f"{name}_sum{_labels(key)} {_fmt(h[-1])}")
                        lines.append(f"{name}_count{_labels(key)} {_fmt(h[len(buckets)])}")
                    continue
                series = self._values[name] or {(): 0.0}
                for key, v in sorted(series.items()):
                    lines.append(f"{name}{_labels(key)} {_fmt(v)}")
        return "\n".join(lines) + "\n"
