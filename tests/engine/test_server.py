"""The OpenAI-compatible server, driven by the official `openai` client (and raw httpx for what a
client library would refuse to send) against uvicorn on a free loopback port."""

import json
import signal

import httpx
import openai
import pytest

from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ar import ARDrafter
from specdecode.policy import FixedK

MAX_LEN = 128  # start_server's default context


@pytest.fixture(scope="module")
def server(tiny_target, start_server):
    s = start_server(tiny_target, max_batch=4, max_queue=4)
    yield s
    s.stop()


def _offline(target, ids, n):
    dec = SpeculativeDecoder(target, ARDrafter(), FixedK(0))
    return dec.generate([GenerationRequest(ids, max_new_tokens=n)])[0]


def test_models_health_metrics(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert server.client.models.retrieve("tiny").id == "tiny"
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    server.client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    m = httpx.get(f"{server.url}/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in (
        "specdecode_requests_total",
        "specdecode_generation_tokens_total",
        "specdecode_tau",
        "specdecode_acceptance_rate",
        "specdecode_queue_depth",
        "specdecode_step_seconds_bucket",
        "specdecode_time_to_first_token_seconds_count",
    ):
        assert name in m.text


def test_completion_matches_offline_greedy_and_streams_the_same(server, tiny_target):
    prompt = "the cat sat on the mat and the cat"
    ids = tiny_target.tokenizer(prompt)["input_ids"]
    ref = _offline(tiny_target, ids, 20)
    r = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == ref.num_new_tokens
    chunks = list(
        server.client.completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == ref.num_new_tokens


def test_chat_plain_and_streamed(server, tiny_target):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = tiny_target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = _offline(tiny_target, list(ids["input_ids"] if hasattr(ids, "keys") else ids), 16)
    r = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    stream = server.client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_several_prompts_n_samples_and_seeds(server):
    kw = dict(model="tiny", prompt=["hello world", "a b c"], n=2, max_tokens=8, temperature=1.0, seed=7)
    a = server.client.completions.create(**kw)
    b = server.client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # a seed reproduces its samples
    tok = server.ctx.tokenizer
    assert a.usage.prompt_tokens == len(tok("hello world")["input_ids"]) + len(tok("a b c")["input_ids"])
    assert 4 <= a.usage.completion_tokens <= 32  # each prompt counted once, every sample's tokens


def test_shutting_down_is_503(server, monkeypatch):
    monkeypatch.setattr(server.engine, "_closing", True)
    assert httpx.get(f"{server.url}/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        server.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and "shutting down" in str(e.value)


BAD = [
    # (raw body or json, status, code or param)
    (b"{not json", 400, "invalid_json"),
    ([1, 2], 400, None),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ({"model": "tiny", "prompt": 42}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "temperature": 5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "12"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "stop": "x" * 257}, 400, "stop"),
    ({"model": "tiny", "prompt": "hi", "stop": [""]}, 400, "stop"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "temperature": "NaN"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ({"model": "tiny", "prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"model": "tiny", "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": "tiny", "prompt": "hi", "stream_options": [1]}, 400, "stream_options"),
    ({"model": "tiny", "prompt": []}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hello " * 200}, 400, "context_length_exceeded"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 1000}, 400, "context_length_exceeded"),
]
BAD_CHAT = [
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"a": 1}]}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 999},
        400,
        None,
    ),
]


def _check_error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert code in (err.get("code"), err.get("param")), err


@pytest.mark.parametrize("payload,status,code", BAD)
def test_bad_completion_requests_get_openai_errors(server, payload, status, code):
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(
        f"{server.url}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    _check_error(r, status, code)


@pytest.mark.parametrize("payload,status,code", BAD_CHAT)
def test_bad_chat_requests_get_openai_errors(server, payload, status, code):
    _check_error(httpx.post(f"{server.url}/v1/chat/completions", json=payload), status, code)


def test_lenient_where_openai_clients_differ(server):
    """Integral floats are integers, unknown fields are ignored, tiny sampling values are valid."""
    for extra in (
        {"max_tokens": 4.0},
        {"user": "someone", "metadata": {"a": "b"}},
        {"temperature": 1e-300, "top_p": 1e-46},
        {"temperature": None, "top_p": None, "n": None, "stop": None, "seed": -5},
        {"stop": ["a", "b", "c", "d"], "response_format": {"type": "text"}, "presence_penalty": 0},
    ):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 200, (extra, r.text)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text


def test_errors_through_the_client_and_routes(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context length"):
        server.client.completions.create(model="tiny", prompt="hi", max_tokens=10_000)
    _check_error(httpx.get(f"{server.url}/v1/nothing"), 404, "not_found")
    _check_error(httpx.get(f"{server.url}/v1/completions"), 405, "method_not_allowed")
    # ... and it goes on serving everyone
    assert (
        server.client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1
    )
    errors = httpx.get(f"{server.url}/metrics").text
    assert 'specdecode_request_errors_total{kind="model_not_found",status="404"}' in errors


def test_disconnect_mid_stream_cancels_and_frees_the_slot(server, monkeypatch):
    server.slow_steps(monkeypatch)
    before = server.engine.metrics.value("specdecode_requests_total", outcome="cancelled")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.engine.decoder.num_active == 1
    server.wait_idle()  # closing the connection aborted the request
    assert server.engine.metrics.value("specdecode_requests_total", outcome="cancelled") == before + 1
    assert server.engine.decoder.num_free_slots == 4


def test_queue_full_is_429_and_the_server_recovers(tiny_target, start_server, monkeypatch):
    s = start_server(tiny_target, max_batch=1, max_queue=1)
    try:
        s.slow_steps(monkeypatch)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body) as r1:
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body) as r2:
                assert r1.status_code == r2.status_code == 200  # one running, one queued
                with pytest.raises(openai.RateLimitError, match="capacity"):
                    s.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        s.wait_idle()
        assert s.client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
    finally:
        s.stop()


def test_graceful_shutdown_finishes_in_flight_streams(tiny_target, start_server):
    s = start_server(tiny_target, grace=10.0, max_batch=2, max_queue=2)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 60, "stream": True, "ignore_eos": True}
    got = []
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                got.append(line)
                if len(got) == 1:
                    s.srv.handle_exit(signal.SIGTERM, None)  # what uvicorn does on SIGTERM
                    assert s.engine.closing
    assert got[-1] == "data: [DONE]"
    finish = [json.loads(x[5:])["choices"][0]["finish_reason"] for x in got[:-1]]
    assert finish[-1] == "length"
    s.thread.join(timeout=20)
    assert not s.thread.is_alive() and not s.engine._thread.is_alive()
    assert s.engine.num_inflight == 0
