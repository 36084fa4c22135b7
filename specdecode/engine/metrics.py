"""Serving metrics on `prometheus_client`, one registry per engine.

Contract: `Metrics` holds the counters, gauges and histograms declared in `METRICS`
(name -> type, help, label names, histogram buckets) in its own `CollectorRegistry`, so two
engines in one process never share a series. `inc`, `set` and `observe` update a series (labels
as keyword arguments); `gauge_fn` makes a gauge read a callback at scrape time (a callback that
raises reads NaN instead of breaking the scrape); `render()` returns the text exposition a
Prometheus server scrapes from `/metrics` (`CONTENT_TYPE` is its media type); `value()` reads one
series back (tests, benchmark reports), 0 for a series never touched and a histogram's count.
Names follow Prometheus conventions: `_total` for counters, `_seconds` for durations. Thread-safe
(prometheus_client locks each series). prometheus_client is imported when an engine is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# name -> (type, help, label names, buckets)
METRICS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "specdecode_requests_total": (
        "counter",
        "Requests finished, by outcome (stop, length, cancelled, error).",
        ("outcome",),
        (),
    ),
    "specdecode_request_errors_total": (
        "counter",
        "Requests refused or failed, by HTTP status and kind.",
        ("status", "kind"),
        (),
    ),
    "specdecode_prompt_tokens_total": ("counter", "Prompt tokens of admitted requests.", (), ()),
    "specdecode_generation_tokens_total": ("counter", "Tokens generated (streamed to clients).", (), ()),
    "specdecode_steps_total": ("counter", "Decode steps (one target forward each).", (), ()),
    "specdecode_verify_rows_total": (
        "counter",
        "Request-steps verified (one per request per step).",
        (),
        (),
    ),
    "specdecode_emitted_tokens_total": ("counter", "Tokens emitted by verification (accepted + 1).", (), ()),
    "specdecode_draft_tokens_total": ("counter", "Draft tokens verified.", (), ()),
    "specdecode_accepted_tokens_total": ("counter", "Draft tokens accepted.", (), ()),
    "specdecode_prefill_tokens_total": ("counter", "Prompt tokens prefilled.", (), ()),
    "specdecode_tau": (
        "gauge",
        "Tokens per verification step per request (emitted / verify rows).",
        (),
        (),
    ),
    "specdecode_acceptance_rate": ("gauge", "Accepted / verified draft tokens.", (), ()),
    "specdecode_queue_depth": ("gauge", "Requests waiting for a slot.", (), ()),
    "specdecode_running_requests": ("gauge", "Requests holding a slot.", (), ()),
    "specdecode_free_slots": ("gauge", "Free cache slots.", (), ()),
    "specdecode_step_seconds": (
        "histogram",
        "Wall time of one engine step (prefill + decode).",
        (),
        _LATENCY,
    ),
    "specdecode_step_batch_tokens": ("histogram", "Tokens per verify forward (rows x block).", (), _COUNT),
    "specdecode_time_to_first_token_seconds": (
        "histogram",
        "Submit to first streamed token.",
        (),
        _LATENCY,
    ),
    "specdecode_request_latency_seconds": ("histogram", "Submit to finish.", (), _LATENCY),
}


def _safe(fn: Callable[[], float]) -> Callable[[], float]:
    def read() -> float:
        try:
            return float(fn())
        except Exception:  # a broken callback must not break the scrape
            return math.nan

    return read


class Metrics:
    def __init__(self) -> None:
        # Deferred: prometheus_client is an optional dependency (the `serve` extra).
        import prometheus_client as pc

        self._pc = pc
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.content_type: str = pc.CONTENT_TYPE_LATEST
        kinds = {"counter": pc.Counter, "gauge": pc.Gauge, "histogram": pc.Histogram}
        self._metrics = {}
        for name, (kind, help_text, labels, buckets) in METRICS.items():
            kw = {"buckets": buckets} if kind == "histogram" else {}
            self._metrics[name] = kinds[kind](name, help_text, labels, registry=self.registry, **kw)

    def _series(self, name: str, labels: dict):
        m = self._metrics[name]
        return m.labels(**{k: str(v) for k, v in labels.items()}) if labels else m

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        self._series(name, labels).inc(value)

    def set(self, name: str, value: float, **labels) -> None:
        self._series(name, labels).set(value)

    def gauge_fn(self, name: str, fn: Callable[[], float]) -> None:
        self._metrics[name].set_function(_safe(fn))

    def observe(self, name: str, value: float, **labels) -> None:
        self._series(name, labels).observe(value)

    def value(self, name: str, **labels) -> float:
        """A counter or gauge series (0 if never set); a histogram's count."""
        sample = f"{name}_count" if METRICS[name][0] == "histogram" else name
        v = self.registry.get_sample_value(sample, {k: str(v) for k, v in labels.items()})
        return 0.0 if v is None else v

    def total(self, name: str) -> float:
        """Sum of a counter over all its label sets."""
        return sum(
            s.value for family in self._metrics[name].collect() for s in family.samples if s.name == name
        )

    def render(self) -> str:
        return self._pc.generate_latest(self.registry).decode()
