"""The server's limits, driven over raw sockets and httpx against uvicorn on a loopback port:
body size enforced while the body streams (chunked or not), slow headers and slow bodies
dropped, the connection limit, deeply nested JSON, cancellation of a non-streamed request whose
client left, tokenization off the event loop and after the cheap checks, and error bodies that
never carry a traceback, an exception's text or a local path."""

import json
import socket
import threading
import time

import httpx
import pytest

from specdecode.engine.server import ServerLimits

LIMITS = ServerLimits(body_timeout_s=1.0, header_timeout_s=1.0, keep_alive_s=1.0, limit_concurrency=64)
MIB = 1 << 20
MAX_LEN = 128  # start_server's default context


@pytest.fixture(scope="module")
def server(tiny_target, start_server):
    s = start_server(tiny_target, limits=LIMITS, max_batch=2, max_queue=2)
    yield s
    s.stop()


def _connect(s) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_until_closed(sock, limit_s: float = 10.0) -> bytes:
    data, deadline = b"", time.time() + limit_s
    while time.time() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        data += chunk
    return data


def _ok(s):
    r = httpx.post(
        f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200, r.text


def _completion(body: bytes, headers=None, s=None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{s.url}/v1/completions", content=body, headers=headers, timeout=30)


def test_a_declared_oversized_body_is_refused_before_it_is_sent(server):
    sock = _connect(server)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {9 * MIB}\r\n\r\n"
    )
    sock.sendall(head.encode())  # ... and not one byte of the body
    reply = _read_until_closed(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply
    assert b"connection: close" in reply.lower()
    _ok(server)


def test_a_chunked_oversized_body_is_cut_off_at_the_limit(server):
    sent = 0

    def body():  # chunked transfer encoding: no Content-Length to check up front
        nonlocal sent
        for _ in range(64):
            sent += MIB
            yield b"x" * MIB

    t0 = time.time()
    try:
        r = httpx.post(f"{server.url}/v1/completions", content=body(), timeout=30)
        status = r.status_code
        assert r.json()["error"]["code"] == "body_too_large"
    except httpx.HTTPError:  # the server closed while we were still sending: also a refusal
        status = 413
    assert status == 413
    # What the client got rid of includes the two loopback socket buffers (a few MiB each), but
    # not the 64 MiB it had to send: the server stopped reading at the limit.
    assert sent <= 24 * MIB, f"the server took {sent >> 20} MiB before refusing"
    assert time.time() - t0 < 10
    _ok(server)


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(server, monkeypatch):
    spy = _SpyTokenizer(server.ctx.tokenizer)
    monkeypatch.setattr(server.ctx, "tokenizer", spy)
    limit = server.ctx.max_prompt_chars
    assert limit is not None and limit < 64 * MAX_LEN  # the tiny vocabulary's entries are short
    t0 = time.time()
    for body in (
        {"model": "tiny", "prompt": "a" * (LIMITS.max_body_bytes - 100)},  # just under 8 MiB
        {"model": "tiny", "prompt": ["hi", "a" * (limit + 1)]},
        {"model": "tiny", "messages": [{"role": "user", "content": "a" * (limit // 2 + 1)}] * 2},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert spy.calls == 0 and time.time() - t0 < 5
    # the bound is safe: a prompt of exactly `limit` characters would need at least MAX_LEN tokens
    ids = spy.real("a" * limit)["input_ids"]
    assert len(ids) >= MAX_LEN


@pytest.mark.parametrize("depth", [100, 2_000, 100_000])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_is_400(server, depth, path):
    r = httpx.post(
        f"{server.url}{path}",
        content=b"[" * depth + b"]" * depth,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    inner = b'{"model": "tiny", "prompt": "hi", "stop": ' + b"[" * depth + b"]" * depth + b"}"
    assert _completion(inner, s=server).status_code == 400


def test_slow_or_silent_headers_are_dropped(server):
    silent = _connect(server)  # connects and says nothing
    slow = _connect(server)
    t0 = time.time()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for i in range(40):  # one header byte every 0.1 s: never finishes within the timeout
        try:
            slow.sendall(b"X-Slow-%d: 1\r\n" % i)
        except OSError:
            break
        time.sleep(0.1)
    reply = _read_until_closed(slow, 5)
    assert time.time() - t0 < LIMITS.header_timeout_s + 3
    assert reply.startswith(b"HTTP/1.1 408") or reply == b""
    assert _read_until_closed(silent, 5).startswith(b"HTTP/1.1 408")
    slow.close()
    silent.close()
    _ok(server)


def test_a_slow_body_gets_408_and_is_dropped(server):
    sock = _connect(server)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode())
    t0 = time.time()
    reply = b""
    for b in body[:30]:  # one byte every 0.1 s: the whole body would take > 3 s
        try:
            sock.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(0.1)
        if time.time() - t0 > LIMITS.body_timeout_s + 0.5:
            break
    reply = _read_until_closed(sock, 5)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_timeout" in reply and b"connection: close" in reply.lower()
    _ok(server)


def test_connection_limit_answers_503(tiny_target, start_server):
    s = start_server(tiny_target, limits=ServerLimits(limit_concurrency=3), max_batch=1, max_queue=1)
    port = int(s.url.rsplit(":", 1)[1])
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        deadline = time.time() + 10
        while len(s.srv.server_state.connections) < 3:  # uvicorn has taken them
            assert time.time() < deadline
            time.sleep(0.02)
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 503
        for h in held:
            h.close()
        deadline = time.time() + 10
        while s.srv.server_state.connections:
            assert time.time() < deadline
            time.sleep(0.02)
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    finally:
        s.stop()


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(server, monkeypatch):
    server.slow_steps(monkeypatch, 0.05)  # 100 tokens take >= 5 s
    m = server.engine.metrics
    before = m.value("specdecode_requests_total", outcome="cancelled")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    t0 = time.time()
    server.wait_idle(timeout=5)
    assert time.time() - t0 < 3  # aborted within a few polls, not after 100 tokens
    assert m.value("specdecode_requests_total", outcome="cancelled") == before + 1
    assert server.engine.decoder.num_free_slots == 2


class _SpyTokenizer:
    """The served tokenizer, counting calls and taking `delay` seconds per call."""

    def __init__(self, real, delay=0.0):
        self.real, self.delay, self.calls = real, delay, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, *a, **kw):
        self.calls += 1
        time.sleep(self.delay)
        return self.real(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.calls += 1
        time.sleep(self.delay)
        return self.real.apply_chat_template(*a, **kw)


def test_tokenization_comes_after_the_cheap_checks_and_off_the_event_loop(server, monkeypatch):
    spy = _SpyTokenizer(server.ctx.tokenizer, delay=3.0)
    monkeypatch.setattr(server.ctx, "tokenizer", spy)
    cheap_failures = [
        {"model": "gpt-9", "prompt": "hi"},
        {"model": "tiny", "prompt": "hi", "temperature": 7},
        {"model": "tiny", "prompt": "hi", "n": 99},
        {"model": "tiny", "prompt": ["a"] * 9, "n": 2},
        {"model": "tiny", "prompt": "hi", "max_tokens": 10**9},
        {"model": "tiny", "prompt": "hi", "stop": ["x" * 300]},
    ]
    for body in cheap_failures:
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=10).status_code in (400, 404)
    assert spy.calls == 0
    slow = threading.Thread(target=_ok, args=(server,))
    slow.start()
    time.sleep(0.5)  # now the tokenizer is busy for 3 s
    t0 = time.time()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert time.time() - t0 < 1.5, "the event loop was blocked by tokenization"
    slow.join()
    assert spy.calls == 1


def _assert_clean(text: str, secret: str, path: str):
    for leak in (secret, path, "Traceback", 'File "', ".py"):
        assert leak not in text, f"{leak!r} leaked into {text[:300]}"


def test_error_bodies_carry_no_traceback_exception_text_or_path(server, monkeypatch, tiny_llama_dir):
    secret = "boom-7f3a"
    path = str(tiny_llama_dir)

    def failing(running, riders):
        raise RuntimeError(f"{secret} while reading {path}/model.safetensors")

    monkeypatch.setattr(server.engine.decoder, "_step", failing)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "decode_failed"
    _assert_clean(r.text, secret, path)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        text = "".join(r.iter_text())
    assert '"error"' in text
    _assert_clean(text, secret, path)
    monkeypatch.undo()

    class Broken:  # a tokenizer that fails with an internal message
        chat_template = None

        def __call__(self, *a, **kw):
            raise OSError(f"{secret}: cannot read {path}/tokenizer.json")

    monkeypatch.setattr(server.ctx, "tokenizer", Broken())
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    _assert_clean(r.text, secret, path)
    monkeypatch.undo()
    server.wait_idle()
    _ok(server)  # and it goes on serving


def test_a_model_directory_is_served_under_its_name_not_its_path(tiny_target, start_server, tiny_llama_dir):
    s = start_server(tiny_target, served_model_name=None, max_batch=1, max_queue=1)
    try:
        path = str(tiny_llama_dir)
        models = httpx.get(f"{s.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [tiny_llama_dir.name]
        assert path not in json.dumps(models)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=10)
        assert r.status_code == 404 and path not in r.text
        r = httpx.post(f"{s.url}/v1/completions", json={"model": path, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == tiny_llama_dir.name  # still accepted
    finally:
        s.stop()
