"""The serving engine: background stepping, thread-safe submit/abort, bounded queue, shutdown,
recovery from a failing step, metrics."""

import queue
import threading
import time

import pytest

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine.engine import Engine, EngineClosed, QueueFull
from specdecode.engine.metrics import Metrics
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.policy import FixedK, ScheduledK, StepCostModel


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")


def _engine(tiny, max_batch=4, max_queue=8, policy=None):
    pol = policy or ScheduledK(4, StepCostModel.flat(step=1.0, per_token=0.01))
    dec = SpeculativeDecoder(tiny, NgramDrafter(), pol, max_batch=max_batch)
    return Engine(dec, max_batch=max_batch, max_model_len=256, max_queue=max_queue, prefill_chunk=32)


class Collector:
    def __init__(self):
        self.q = queue.Queue()

    def __call__(self, ev):
        self.q.put(ev)

    def wait(self, timeout=30):
        text, tokens = "", []
        while True:
            ev = self.q.get(timeout=timeout)
            text += ev.text
            tokens += ev.token_ids
            if ev.finished:
                return text, tokens, ev


def _req(tok, text, n=16, rid="0", **kw):
    return GenerationRequest(tok(text)["input_ids"], max_new_tokens=n, id=rid, ignore_eos=True, **kw)


def _wait_idle(engine, timeout=10):
    deadline = time.time() + timeout
    while engine.num_inflight or engine.decoder.num_active:
        assert time.time() < deadline, "engine did not free its slots"
        time.sleep(0.01)


def test_concurrent_requests_match_offline_decoding(tiny):
    tok = tiny.tokenizer
    texts = ["the cat sat on the mat and the cat", "hello world, hello", "a b c d e f g a b c"] * 2
    offline = SpeculativeDecoder(tiny, NgramDrafter(), FixedK(0), max_batch=8).generate(
        [_req(tok, t, rid=str(i)) for i, t in enumerate(texts)]
    )
    engine = _engine(tiny).start()
    try:
        sinks = [Collector() for _ in texts]
        threads = [
            threading.Thread(target=engine.submit, args=(_req(tok, t, rid=str(i)), s))
            for i, (t, s) in enumerate(zip(texts, sinks, strict=True))
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for s, ref in zip(sinks, offline, strict=True):
            text, tokens, last = s.wait()
            assert last.result is not None and last.error is None
            assert tokens == ref.token_ids and text == ref.text
        _wait_idle(engine)
        m = engine.metrics
        assert m.value("specdecode_generation_tokens_total") == 16 * len(texts)
        assert m.value("specdecode_requests_total", outcome="length") == len(texts)
        assert m.value("specdecode_tau") >= 1.0
        assert engine.decoder.num_free_slots == 4
    finally:
        engine.shutdown(grace_s=1)


def _slow(monkeypatch, engine, delay=0.01):
    real_step = engine.decoder._step

    def slow(running, riders):
        time.sleep(delay)
        return real_step(running, riders)

    monkeypatch.setattr(engine.decoder, "_step", slow)


def test_abort_frees_the_slot_and_cancels(tiny, monkeypatch):
    engine = _engine(tiny, max_batch=1, policy=FixedK(0)).start()
    _slow(monkeypatch, engine)  # 200 tokens take >= 2 s: the abort lands first
    try:
        s = Collector()
        engine.submit(_req(tiny.tokenizer, "hello world", n=200), s)
        first = s.q.get(timeout=10)  # it is streaming
        assert not first.finished
        engine.abort("0")
        _, _, last = s.wait()
        assert last.error == "cancelled"
        _wait_idle(engine)
        assert engine.decoder.num_free_slots == 1
        assert engine.metrics.value("specdecode_requests_total", outcome="cancelled") == 1
        engine.abort("0")  # idempotent
    finally:
        engine.shutdown(grace_s=1)


def test_bounded_queue_and_validation(tiny):
    engine = _engine(tiny, max_batch=1, max_queue=1)  # not started: nothing drains the queue
    tok = tiny.tokenizer
    engine.submit(_req(tok, "a", rid="a"), Collector())
    engine.submit(_req(tok, "b", rid="b"), Collector())
    with pytest.raises(QueueFull, match="capacity"):
        engine.submit(_req(tok, "c", rid="c"), Collector())
    with pytest.raises(SpecDecodeError, match="already in flight"):
        engine.submit(_req(tok, "a", rid="a"), Collector())
    with pytest.raises(SpecDecodeError, match="served context"):
        engine.submit(_req(tok, "a", n=300, rid="d"), Collector())
    engine.start()
    _wait_idle(engine)
    engine.shutdown(grace_s=1)
    with pytest.raises(EngineClosed):
        engine.submit(_req(tok, "a", rid="e"), Collector())


def test_graceful_shutdown_finishes_or_cancels(tiny, monkeypatch):
    engine = _engine(tiny, max_batch=2, policy=FixedK(0)).start()
    _slow(monkeypatch, engine, 0.02)  # the short request needs ~0.16 s, the long one ~5 s
    short, long = Collector(), Collector()
    engine.submit(_req(tiny.tokenizer, "hello", n=8, rid="short"), short)
    engine.submit(_req(tiny.tokenizer, "hello", n=240, rid="long", params=SamplingParams(1.0)), long)
    engine.shutdown(grace_s=1.0)
    assert short.wait()[2].result is not None  # finished within the grace period
    assert long.wait()[2].error.startswith("cancelled")
    assert not engine._thread.is_alive()
    assert engine.num_inflight == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny, monkeypatch):
    engine = _engine(tiny).start()
    try:
        real_step = engine.decoder._step
        calls = {"n": 0}

        def flaky(running, riders):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real_step(running, riders)

        monkeypatch.setattr(engine.decoder, "_step", flaky)
        s = Collector()
        engine.submit(_req(tiny.tokenizer, "hello world", n=20), s)
        _, _, last = s.wait()
        assert last.error is not None and "internal error" in last.error
        assert "boom" not in last.error  # exception text goes to the log, not to clients
        s2 = Collector()
        engine.submit(_req(tiny.tokenizer, "hello world", n=5, rid="1"), s2)
        assert s2.wait()[2].result.num_new_tokens == 5
        _wait_idle(engine)
        assert engine.decoder.num_free_slots == 4
    finally:
        engine.shutdown(grace_s=1)


def test_a_consumer_that_raises_only_loses_its_own_request(tiny):
    engine = _engine(tiny).start()
    try:

        def broken(ev):
            raise ValueError("consumer bug")

        engine.submit(_req(tiny.tokenizer, "hello world", n=50, rid="bad"), broken)
        s = Collector()
        engine.submit(_req(tiny.tokenizer, "hello world", n=10, rid="good"), s)
        assert s.wait()[2].result.num_new_tokens == 10
        _wait_idle(engine)
    finally:
        engine.shutdown(grace_s=1)


def test_metrics_render_prometheus_text():
    m = Metrics()
    m.inc("specdecode_requests_total", outcome="stop")
    m.inc("specdecode_request_errors_total", status="400", kind='bad "json"')
    m.observe("specdecode_step_seconds", 0.02)
    m.gauge_fn("specdecode_queue_depth", lambda: 3)
    text = m.render()
    assert "# TYPE specdecode_requests_total counter" in text
    assert 'specdecode_requests_total{outcome="stop"} 1' in text
    assert 'kind="bad \\"json\\""' in text
    assert 'specdecode_step_seconds_bucket{le="0.025"} 1' in text
    assert 'specdecode_step_seconds_bucket{le="0.01"} 0' in text
    assert "specdecode_step_seconds_count 1" in text
    assert "specdecode_queue_depth 3" in text
    assert m.value("specdecode_queue_depth") == 3


def test_one_failing_request_ends_alone_in_the_engine(tiny, monkeypatch):
    """A row whose logits turn NaN ends its own request with an error; a neighbour finishes."""
    engine = _engine(tiny).start()
    try:
        real_forward = engine.decoder.model.forward
        poisoned = {"slot": None}

        def forward(ids, positions, cache, slots, **kw):
            out = real_forward(ids, positions, cache, slots, **kw)
            if out.logits is not None and poisoned["slot"] in slots:
                out.logits[slots.index(poisoned["slot"])] = float("nan")
            return out

        monkeypatch.setattr(engine.decoder.model, "forward", forward)
        bad, good = Collector(), Collector()
        engine.submit(_req(tiny.tokenizer, "hello world", n=40, rid="good"), good)
        poisoned["slot"] = 2  # slots are handed out from 0: the second request gets slot 1 or 2
        engine.submit(_req(tiny.tokenizer, "the cat sat", n=40, rid="bad"), bad)
        deadline = time.time() + 10
        while poisoned["slot"] == 2 and time.time() < deadline:
            active = [r for r in engine.decoder._prefilling + engine.decoder._running if r.req.id == "bad"]
            if active:
                poisoned["slot"] = active[0].slot
            time.sleep(0.001)
        _, _, last = bad.wait()
        assert last.error is not None and "not finite" in last.error
        text, tokens, done = good.wait()
        assert done.result is not None and done.result.num_new_tokens == 40
        _wait_idle(engine)
        assert engine.decoder.num_free_slots == 4
    finally:
        engine.shutdown(grace_s=1)


def test_admission_takes_clients_in_turn(tiny):
    """One client's burst does not stand in front of another client's request: with one slot,
    a (client a, three requests), then (client b, one request) are admitted a, b, a, a."""
    engine = _engine(tiny, max_batch=1)  # not started: all four wait before the first step
    tok, done, sinks = tiny.tokenizer, [], {}

    def sink(rid):
        def put(ev):
            if ev.finished:
                done.append(rid)
            sinks[rid](ev)

        return put

    for rid, client in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]:
        sinks[rid] = Collector()
        engine.submit(_req(tok, "hello", n=2, rid=rid), sink(rid), client=client)
    assert engine.num_waiting == 4
    engine.start()
    for s in sinks.values():
        s.wait()
    assert done == ["a1", "b1", "a2", "a3"]  # FIFO would have been a1, a2, a3, b1
    _wait_idle(engine)
    assert engine.num_waiting == 0 and engine.decoder.num_free_slots == 1
    engine.shutdown(grace_s=1)


def test_abort_of_a_request_waiting_for_its_turn(tiny, monkeypatch):
    engine = _engine(tiny, max_batch=1, policy=FixedK(0)).start()
    _slow(monkeypatch, engine)
    try:
        first, queued = Collector(), Collector()
        engine.submit(_req(tiny.tokenizer, "hello world", n=200, rid="run"), first, client="a")
        first.q.get(timeout=10)  # holds the only slot
        engine.submit(_req(tiny.tokenizer, "hello", n=4, rid="wait"), queued, client="b")
        assert engine.num_waiting == 1
        engine.abort("wait")
        assert queued.wait()[2].error == "cancelled"
        assert engine.num_waiting == 0
        engine.abort("run")
        assert first.wait()[2].error == "cancelled"
        _wait_idle(engine)
        assert engine.decoder.num_free_slots == 1
    finally:
        engine.shutdown(grace_s=1)
