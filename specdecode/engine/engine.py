"""Serving engine: continuous batching over one `SpeculativeDecoder`, stepped by one thread.

Contract:
- `Engine(decoder, max_batch, max_model_len, max_queue)` reserves the decoder's cache once
  (`max_batch` slots of `max_model_len` tokens) and turns on chunked prefill. `start()` runs the
  step loop in a background thread; requests join and leave between steps.
- `submit(request, sink, client=None)` is thread-safe. It raises `SpecDecodeError` for a request
  the model cannot serve (the caller's 4xx), `QueueFull` when `max_batch + max_queue` requests are
  already in flight, and `EngineClosed` after `shutdown()` began. Otherwise the engine thread calls
  `sink(EngineEvent)` for every step that produced text, and exactly once with
  `event.finished` true: the result, or `error` ("cancelled" after `abort`, or what failed).
- Admission is fair between clients: waiting requests queue per `client` (the server passes the
  connection; None: the request is a client of its own) and a free slot goes to the clients in
  turn (round robin), so one client's many choices or requests never stand in front of another
  client's next request. The decoder is handed no more requests than it has free slots.
- `abort(request_id)` is thread-safe and idempotent; between steps the request leaves its slot
  (or the queue) and its sink gets the final cancelled event.
- `shutdown(grace_s)` refuses new requests, lets in-flight ones finish for up to `grace_s`,
  then cancels the rest and stops the thread.
- A request that fails inside a step (the decoder ends it with `finish_reason == "error"`) gets
  its own error; its neighbours go on. A step that raises fails the requests in flight (their
  sinks get a generic error; the exception goes to the log, never to clients), resets the
  decoder and the engine goes on serving. Sinks run on the engine thread: they must be quick; one that
  raises has its request aborted.
- `metrics` (metrics.py) counts requests, tokens, tau, acceptance, queue depth and step time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from specdecode.decode import GenerationRequest, GenerationResult, SpeculativeDecoder
from specdecode.engine.metrics import Metrics
from specdecode.errors import SpecDecodeError

log = logging.getLogger("specdecode.engine")

DEFAULT_PREFILL_CHUNK = 256


class QueueFull(Exception):
    """The engine holds as many requests as it may queue; retry later (HTTP 429)."""


class EngineClosed(Exception):
    """The engine is shutting down (HTTP 503)."""


@dataclass
class EngineEvent:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    result: GenerationResult | None = None  # set on a successful final event
    error: str | None = None  # set on a failed final event ("cancelled" after abort)

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class _Inflight:
    sink: Callable[[EngineEvent], None]
    t_submit: float
    prompt_tokens: int
    client: Hashable = None
    first_token: bool = False


class Engine:
    def __init__(
        self,
        decoder: SpeculativeDecoder,
        max_batch: int | None = None,
        max_model_len: int | None = None,
        max_queue: int = 64,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ):
        info = decoder.model.info
        max_batch = max_batch or decoder.max_batch
        if info.max_slots is not None and max_batch > info.max_slots:
            raise SpecDecodeError(
                f"{info.arch} serves at most {info.max_slots} request(s) at a time; "
                f"use --max-batch {info.max_slots}"
            )
        max_model_len = max_model_len or info.max_position
        if not 2 <= max_model_len <= info.max_position:
            raise SpecDecodeError(
                f"--max-model-len must be in 2..{info.max_position} (the model's context), "
                f"got {max_model_len}"
            )
        if max_queue < 0:
            raise SpecDecodeError(f"--max-queue must be >= 0, got {max_queue}")
        self.decoder, self.max_batch, self.max_model_len, self.max_queue = (
            decoder,
            max_batch,
            max_model_len,
            max_queue,
        )
        decoder.max_batch = max_batch
        decoder.prefill_chunk = decoder.prefill_budget = prefill_chunk
        decoder.reserve(max_batch, max_model_len + decoder.k_max + 2)
        self.metrics = Metrics()
        self.metrics.gauge_fn("specdecode_queue_depth", lambda: self.num_waiting)
        self.metrics.gauge_fn("specdecode_running_requests", lambda: self.decoder.num_active)
        self.metrics.gauge_fn("specdecode_free_slots", lambda: self.decoder.num_free_slots)
        self._cond = threading.Condition()
        self._adds: list[tuple[Hashable, GenerationRequest]] = []
        # client -> its waiting requests, in turn order (engine thread only)
        self._queues: OrderedDict[Hashable, deque[GenerationRequest]] = OrderedDict()
        self._num_queued = 0
        self._aborts: list[str] = []
        self._inflight: dict[str, _Inflight] = {}
        self._closing = self._stop = False
        self._thread: threading.Thread | None = None

    # ---- public, thread-safe ------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_waiting(self) -> int:
        return self.decoder.num_waiting + len(self._adds) + self._num_queued

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specdecode-engine", daemon=True)
            self._thread.start()
        return self

    def submit(
        self, req: GenerationRequest, sink: Callable[[EngineEvent], None], client: Hashable = None
    ) -> None:
        self.decoder.check_request(req)  # pure validation: safe from any thread
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down; retry on another replica or later")
            if req.id in self._inflight:
                raise SpecDecodeError(f"request id {req.id!r} is already in flight")
            if len(self._inflight) >= self.max_batch + self.max_queue:
                raise QueueFull(
                    f"the server is at capacity ({self.max_batch} running + {self.max_queue} queued "
                    "requests); retry later"
                )
            client = ("request", req.id) if client is None else client
            self._inflight[req.id] = _Inflight(sink, time.perf_counter(), len(req.prompt_ids), client)
            self._adds.append((client, req))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._inflight:
                self._aborts.append(request_id)
                self._cond.notify()

    def close(self) -> None:
        """Refuse new requests from now on (EngineClosed); in-flight ones go on."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuse new requests; finish in-flight ones for up to grace_s, cancel the rest; stop."""
        self.close()
        deadline = time.monotonic() + grace_s
        while self._inflight and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.02)
        with self._cond:
            self._stop = True
            self._aborts.extend(self._inflight)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for rid in list(self._inflight):  # the thread never ran, or died
            self._finish(rid, error="cancelled: the server shut down")

    # ---- engine thread ------------------------------------------------------------------
    def _finish(self, rid: str, result: GenerationResult | None = None, error: str | None = None) -> None:
        info = self._inflight.pop(rid, None)
        if info is None:
            return
        outcome = (
            result.finish_reason
            if result is not None
            else ("cancelled" if error.startswith("cancel") else "error")
        )
        self.metrics.inc("specdecode_requests_total", outcome=outcome)
        self.metrics.observe("specdecode_request_latency_seconds", time.perf_counter() - info.t_submit)
        self._deliver(info, EngineEvent(rid, result=result, error=error))

    def _deliver(self, info: _Inflight, event: EngineEvent) -> bool:
        try:
            info.sink(event)
            return True
        except Exception:  # a broken consumer must not take the engine down
            log.exception("request %s: its consumer failed; aborting it", event.request_id)
            return False

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._adds
                    or self._aborts
                    or self._stop
                    or self._closing
                    or self._queues
                    or self.decoder.has_unfinished()
                ):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stop = self._stop
            for client, req in adds:
                self._queues.setdefault(client, deque()).append(req)
                self._num_queued += 1
            for rid in aborts:
                if not self._unqueue(rid):
                    self.decoder.abort(rid)
                self._finish(rid, error="cancelled")
            self._admit()
            if stop:
                for rid in self.decoder.abort_all():
                    self._finish(rid, error="cancelled: the server shut down")
                return
            if not self.decoder.has_unfinished():
                if self._closing and not self._inflight:
                    time.sleep(0.01)  # shutdown() is about to set _stop
                continue
            self._step()

    def _unqueue(self, rid: str) -> bool:
        """Drop a request still waiting in its client's queue; False if it is not there."""
        info = self._inflight.get(rid)
        queue = self._queues.get(info.client) if info is not None else None
        for req in queue or ():
            if req.id == rid:
                queue.remove(req)
                self._num_queued -= 1
                if not queue:
                    del self._queues[info.client]
                return True
        return False

    def _admit(self) -> None:
        """Hand the decoder as many waiting requests as it has free slots, one per client in turn."""
        while self._queues and self.decoder.num_active + self.decoder.num_waiting < self.max_batch:
            client, queue = next(iter(self._queues.items()))
            req = queue.popleft()
            self._num_queued -= 1
            if queue:
                self._queues.move_to_end(client)  # its next request waits for the others' turn
            else:
                del self._queues[client]
            try:
                self.decoder.add_request(req)
                self.metrics.inc("specdecode_prompt_tokens_total", len(req.prompt_ids))
            except SpecDecodeError as e:
                self._finish(req.id, error=str(e))

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.decoder.step()
        except Exception as e:  # a bug or an exhausted device: fail these requests, keep serving
            log.exception("engine step failed")
            for rid in self.decoder.abort_all():
                self._finish(
                    rid,
                    error=f"internal error in a decoding step ({type(e).__name__}; see the log)",
                )
            return
        dt = time.perf_counter() - t0
        self._record_step(dt)
        now = time.perf_counter()
        for ev in events:
            info = self._inflight.get(ev.request_id)
            if info is None:
                continue
            if ev.token_ids:
                self.metrics.inc("specdecode_generation_tokens_total", len(ev.token_ids))
                if not info.first_token:
                    info.first_token = True
                    self.metrics.observe("specdecode_time_to_first_token_seconds", now - info.t_submit)
            if ev.result is not None:
                if ev.text or ev.token_ids:
                    self._deliver(info, EngineEvent(ev.request_id, ev.text, ev.token_ids))
                if ev.result.error is not None:
                    self._finish(ev.request_id, error=ev.result.error)
                else:
                    self._finish(ev.request_id, result=ev.result)
            elif not self._deliver(info, EngineEvent(ev.request_id, ev.text, ev.token_ids)):
                self.decoder.abort(ev.request_id)
                self._inflight.pop(ev.request_id, None)
                self.metrics.inc("specdecode_requests_total", outcome="error")

    def _record_step(self, dt: float) -> None:
        st, m = self.decoder.last_step, self.metrics
        m.observe("specdecode_step_seconds", dt)
        m.inc("specdecode_prefill_tokens_total", st.prefill_tokens)
        if st.num_rows == 0:
            return
        m.inc("specdecode_steps_total")
        m.inc("specdecode_verify_rows_total", st.num_rows)
        m.inc("specdecode_emitted_tokens_total", st.num_emitted)
        m.inc("specdecode_draft_tokens_total", st.num_draft)
        m.inc("specdecode_accepted_tokens_total", st.num_accepted)
        m.observe("specdecode_step_batch_tokens", st.num_rows * st.block)
        rows = m.value("specdecode_verify_rows_total")
        m.set("specdecode_tau", m.value("specdecode_emitted_tokens_total") / max(rows, 1))
        drafted = m.value("specdecode_draft_tokens_total")
        m.set(
            "specdecode_acceptance_rate",
            m.value("specdecode_accepted_tokens_total") / drafted if drafted else 0.0,
        )
