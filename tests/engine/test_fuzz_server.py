"""Fuzz and abuse of the running server (uvicorn on a loopback port, tiny random-weight model).

- `schemathesis` generates requests from the server's own `/openapi.json`, schema-valid and
  schema-violating, for every operation; each answer must be documented (status, media type,
  error body schema), never a 5xx, never leak internals, and a schema-violating request must
  be refused with a 4xx.
- `hypothesis` generates completion bodies with adversarial sampling values (tiny and huge
  numbers, NaN and infinities as strings, huge max_tokens and seeds, odd stop lists).
- A barrage runs every abuse kind at once (deep nesting, chunked oversize body, slow headers,
  slow body, disconnecting clients) alongside valid traffic.
After each: no 5xx, the server answers, no request holds a slot (engine idle, all slots free).
Short form here (about 450 requests, derandomized, bounded in time); the long form is
benchmarks/soak_serve.py.
"""

import json
import socket
import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from specdecode.engine.server import ServerLimits

MAX_LEN = 32  # short completions keep the fuzzing fast
MAX_BATCH = 4
FUZZ = settings(
    max_examples=200,
    derandomize=True,  # the same examples on every CI run; benchmarks/soak_serve.py explores
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
LIMITS = ServerLimits(body_timeout_s=1.0, header_timeout_s=1.0, keep_alive_s=2.0)
LEAKS = ("Traceback", 'File "', '.py"', "/tmp/", "/home/", "/root/")


@pytest.fixture(scope="module")
def server(tiny_target, start_server):
    s = start_server(tiny_target, limits=LIMITS, max_batch=MAX_BATCH, max_queue=64, max_model_len=MAX_LEN)
    s.http = httpx.Client(base_url=s.url, timeout=30)
    yield s
    s.http.close()
    s.stop()


def _assert_healthy(s):
    """The server answers, holds no request and has every slot free; it logged no 5xx."""
    s.wait_idle(timeout=20)
    assert s.engine.num_inflight == 0 and s.engine.decoder.num_free_slots == MAX_BATCH
    assert s.http.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    r = s.http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
    errors = s.engine.metrics
    fives = [
        line
        for line in errors.render().splitlines()
        if line.startswith("specdecode_request_errors_total{") and 'status="5' in line
    ]
    assert not fives, fives


def _no_leak(ctx, response, case):
    """A schemathesis check: error bodies carry no traceback or local path."""
    if response.status_code >= 400:
        for leak in LEAKS:
            assert leak not in response.text, f"{leak!r} in {response.text[:300]}"


@pytest.fixture(scope="module")
def api(server):
    raw = server.http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    ops = [r.ok() for r in schema.get_all_operations()]
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    return st.one_of([op.as_strategy(generation_mode=m) for op in ops for m in modes])


_UNSUPPORTED = (
    "presence_penalty frequency_penalty repetition_penalty min_p logit_bias top_logprobs response_format "
    "tools functions logprobs echo suffix best_of"
).split()


def _focus(body: dict) -> None:
    """Drop the parameters this server refuses at anything but their neutral value; short answers."""
    for name in _UNSUPPORTED:
        body.pop(name, None)
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int):
            body[name] = 1 + body[name] % 8
    if isinstance(body.get("n"), int):
        body["n"] = 1 + body["n"] % 2
    for m in body.get("messages") or []:
        if isinstance(m, dict) and m.get("content") is None:
            m["content"] = "hello"  # the schema allows null (assistant turns); the others need text
    if body.get("prompt") in ("", []):
        body["prompt"] = "hello"


def test_schemathesis_fuzz_of_the_openapi_schema(server, api):
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        negative_data_rejection,
        _no_leak,
    ]
    seen = {}

    @FUZZ
    @given(case=api, focus=st.booleans())
    def run(case, focus):
        if focus and isinstance(case.body, dict) and case.meta.generation.mode.value == "positive":
            _focus(case.body)  # so that more schema-valid requests reach the engine
        response = case.call(base_url=server.url, timeout=30)
        key = (case.operation.label, case.meta.generation.mode.value if case.meta else "?")
        seen.setdefault(key, []).append(response.status_code)
        case.validate_response(response, checks=checks)

    run()
    assert sum(map(len, seen.values())) >= 200
    posts = [s for (label, _), codes in seen.items() if label.startswith("POST") for s in codes]
    assert posts.count(200) >= 5 and 400 in posts, seen  # some reached the engine, some were refused
    _assert_healthy(server)


_TINY = [1e-300, 5e-324, 1e-46, 1.4e-45, 1e-38, 9.99e-6, 1e-5, 1.0000001e-5]
_NUMBERS = st.one_of(
    st.sampled_from(_TINY + [0.0, -0.0, 1.0, 2.0, 2.0000001, -1e-300, 1e308, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**70), 2**70),
    st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "inf", "1e-300", "0.5", None, True, [], {}]),
)
_RAW = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 5000])


_VALID = {  # in range, with the adversarial corners (tiny values the core treats specially)
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from(_TINY)),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from(_TINY)),
    "top_k": st.integers(-1, 2**40),
    "max_tokens": st.integers(1, 8),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "n": st.integers(1, 3),
}
_TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=40)  # Cs: surrogates


@st.composite
def _bodies(draw):
    """A completion body with adversarial values, and sometimes a raw JSON literal spliced in."""
    body = {"model": "tiny", "prompt": draw(st.one_of(_TEXT, st.just("hello")))}
    for name in draw(st.sets(st.sampled_from(sorted(_VALID)))):
        body[name] = draw(st.one_of(_VALID[name], _VALID[name], _NUMBERS))  # mostly in range
    body.setdefault("max_tokens", draw(_VALID["max_tokens"]))
    if draw(st.booleans()):
        body["stop"] = draw(st.one_of(st.text(max_size=300), st.lists(_TEXT, max_size=6)))
    body["stream"] = draw(st.booleans())
    raw = json.dumps(body)  # unpaired surrogates travel as \ud800 escapes, as a client may send them
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "seed"]))
        raw = raw[:-1] + f', "{name}": {draw(_RAW)}}}'
    return raw


def test_hypothesis_adversarial_sampling_values(server):
    statuses = []

    @FUZZ
    @given(raw=_bodies())
    def run(raw):
        r = server.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error"
            assert not any(leak in r.text for leak in LEAKS)
        elif not json.loads(raw).get("stream"):
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")
        else:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text

    run()
    assert statuses.count(200) >= 10 and statuses.count(400) >= 10
    _assert_healthy(server)


@pytest.mark.parametrize(
    "extra,status",
    [
        ({"temperature": 1e-300}, 200),  # below MIN_TEMPERATURE: greedy
        ({"temperature": 5e-324}, 200),
        ({"top_p": 1e-46}, 200),  # below fp32's smallest mass: the top token
        ({"top_p": 5e-324, "temperature": 2.0}, 200),
        ({"top_k": 2**62}, 200),
        ({"temperature": "NaN"}, 400),
        ({"top_p": "1e-46"}, 400),
        ({"max_tokens": 2**62}, 400),
        ({"seed": 2**64}, 400),
        ({"prompt": "\ud800 unpaired"}, 400),
        ({"stop": ["\udfff"]}, 400),
    ],
)
def test_adversarial_sampling_values(server, extra, status):
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra})  # \ud800 escapes
    r = server.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status == 200:
        finish = r.json()["choices"][0]["finish_reason"]
        if "top_k" in extra:  # sampled at the default temperature: it may draw EOS within 4 tokens
            assert finish in ("stop", "length")
        else:  # greedy either way: a tiny temperature equals temperature 0, a tiny top_p the top token
            assert finish == "length"


def _deep(s):
    d = 100_000
    return s.http.post(
        "/v1/completions", content=b"[" * d + b"]" * d, headers={"content-type": "application/json"}
    )


def _chunked_oversize(s):
    def body():
        for _ in range(32):
            yield b"x" * (1 << 20)

    try:
        return s.http.post("/v1/completions", content=body())
    except httpx.HTTPError:  # the server closed while we were still sending
        return None


def _raw_socket(s, payload: bytes, trickle: bytes):
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    try:
        sock.sendall(payload)
        for b in trickle:
            sock.sendall(bytes([b]))
            time.sleep(0.1)
    except OSError:
        pass  # dropped by the server, as it should be
    finally:
        reply = b""
        try:
            reply = sock.recv(4096)
        except OSError:
            pass
        sock.close()
    return reply


def _slow_header(s):
    return _raw_socket(s, b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\nX-Slow: " + b"a" * 30)


def _slow_body(s):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    return _raw_socket(s, head, b'{"model": "tiny", "prompt": "' + b"a" * 30)


def _disconnect_stream(s):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with s.http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first event


def _disconnect_plain(s):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 30, "ignore_eos": True, "n": 4}
    try:
        httpx.post(f"{s.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
    except httpx.TimeoutException:
        pass


def _valid(s):
    r = s.http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code in (200, 429), r.text
    return r


def test_abuse_barrage_alongside_valid_traffic(server):
    kinds = [
        _deep,
        _chunked_oversize,
        _slow_header,
        _slow_body,
        _disconnect_stream,
        _disconnect_plain,
        _valid,
    ]
    failures, statuses = [], []
    deadline = time.time() + 20  # bounded in time whatever happens

    def worker(kind):
        for _ in range(3):
            if time.time() > deadline:
                return
            try:
                r = kind(server)
                if isinstance(r, httpx.Response):
                    statuses.append(r.status_code)
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append(f"{kind.__name__}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in kinds for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures, failures
    assert not [s for s in statuses if s >= 500], statuses
    assert {400, 413} <= set(statuses)
    _assert_healthy(server)
