"""OpenAI-compatible request validation and response shapes (completions, chat completions).

Contract:
- `parse_completion(body, ctx)` and `parse_chat(body, ctx)` take a decoded JSON body and return
  a `ParsedRequest`: one `GenerationRequest` per choice (prompt-major, then the `n` samples of a
  prompt, as OpenAI numbers choices), the stream flags and the prompt token counts. Anything a
  client can get wrong raises `APIError` with the HTTP status and OpenAI's error body
  (`{"error": {"message", "type", "param", "code"}}`): malformed fields and wrong types (400),
  impossible values (400), an unknown model (404), a prompt over the context or more tokens
  than fit (400, code `context_length_exceeded`), parameters this server cannot honour while
  staying lossless (penalties, logit bias, logprobs: 400 naming the parameter).
- Sampling defaults follow OpenAI: temperature 1, top_p 1; completions default to 16 new
  tokens, chat to the rest of the context. `top_k` and `ignore_eos` are accepted extensions.
  A request without `seed` gets a random one; choice j > 0 of a seeded request uses
  `derive_seed(seed, j)`, so `n` samples differ and a seed reproduces them.
- `completion_body`, `completion_chunk`, `chat_body`, `chat_chunk` and `usage` build the
  response objects; `sse(obj)` frames one server-sent event.
"""

from __future__ import annotations

import json
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field

from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.prompts import derive_seed
from specdecode.request import GenerationRequest

MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED_NONZERO = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServeContext:
    """What request parsing needs to know about the served model."""

    model_name: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    aliases: tuple[str, ...] = ()
    max_choices: int = 16

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)


@dataclass
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    requests: list[GenerationRequest]
    prompt_tokens: list[int]  # per choice
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # samples per prompt
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_prompt_tokens(self) -> int:
        # OpenAI counts each prompt once, however many samples (n) it has.
        return sum(self.prompt_tokens[:: self.n])


# ---- field readers ----------------------------------------------------------------------
def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(f"'{name}' must be {rng}, got {v}", name)
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"'{name}' must be a number, got {json.dumps(v)}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise _bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def _model(body: dict, ctx: ServeContext) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required: a string naming the served model (see GET /v1/models)", "model")
    if model not in ctx.names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{ctx.model_name}' (GET /v1/models)",
            "model",
            "model_not_found",
        )
    return model


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return tuple(stop)


def _unsupported(body: dict) -> None:
    for name in UNSUPPORTED_NONZERO:
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise _bad(f"'{name}' must be a number, got {json.dumps(v)}", name)
        if v not in (None, 0, 0.0) and not (name == "repetition_penalty" and v == 1):
            raise _bad(
                f"'{name}' is not supported by this server (decoding is lossless); leave it at 0", name
            )
    if body.get("logit_bias"):
        raise _bad("'logit_bias' is not supported by this server", "logit_bias")
    lp = body.get("logprobs")
    if lp not in (None, False, 0):
        raise _bad("'logprobs' is not supported by this server", "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise _bad("'top_logprobs' is not supported by this server", "top_logprobs")
    if body.get("echo") not in (None, False):
        raise _bad("'echo' is not supported by this server", "echo")
    if body.get("suffix") not in (None, ""):
        raise _bad("'suffix' is not supported by this server", "suffix")
    if body.get("tools") or body.get("functions"):
        raise _bad("tool and function calling are not supported by this server", "tools")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("only response_format {'type': 'text'} is supported", "response_format")


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, lo=-1)
    try:
        return SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p)
    except SpecDecodeError as e:
        raise _bad(str(e)) from None


def _check_length(n_prompt: int, max_tokens: int | None, ctx: ServeContext, param: str) -> int:
    if n_prompt >= ctx.max_model_len:
        raise _bad(
            f"This model's maximum context length is {ctx.max_model_len} tokens; your prompt has "
            f"{n_prompt} tokens. Shorten the prompt.",
            "messages" if param == "max_completion_tokens" else "prompt",
            "context_length_exceeded",
        )
    if max_tokens is None:
        return ctx.max_model_len - n_prompt
    if n_prompt + max_tokens > ctx.max_model_len:
        raise _bad(
            f"This model's maximum context length is {ctx.max_model_len} tokens; you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
            f"Lower {param} to at most {ctx.max_model_len - n_prompt} or shorten the prompt.",
            param,
            "context_length_exceeded",
        )
    return max_tokens


def _choices(
    kind: str,
    model: str,
    prompts: list[list[int]],
    body: dict,
    max_tokens: int | None,
    ctx: ServeContext,
    param: str,
) -> ParsedRequest:
    n = _int(body, "n", 1, lo=1, hi=ctx.max_choices)
    if len(prompts) * n > ctx.max_choices:
        raise _bad(
            f"at most {ctx.max_choices} choices per request (prompts x n), got {len(prompts) * n}", "n"
        )
    best_of = _int(body, "best_of", n, lo=1)
    if best_of != n:
        raise _bad("'best_of' other than n is not supported", "best_of")
    params = _sampling(body)
    stop = _stop(body)
    seed = _int(body, "seed", None)
    ignore_eos = _bool(body, "ignore_eos")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    _unsupported(body)
    parsed = ParsedRequest(kind, model, [], [], stream=stream, include_usage=include_usage, n=n)
    for p, ids in enumerate(prompts):
        budget = _check_length(len(ids), max_tokens, ctx, param)
        for j in range(n):
            index = p * n + j
            if seed is None:
                s = secrets.randbits(63)
            else:
                s = seed if index == 0 else derive_seed(seed, index)
            req = GenerationRequest(
                list(ids), params, budget, stop, s, id=f"{parsed.id}-{index}", ignore_eos=ignore_eos
            )
            parsed.requests.append(req)
            parsed.prompt_tokens.append(len(ids))
    return parsed


# ---- endpoints ----------------------------------------------------------------------------
def _token_list(v, ctx: ServeContext, param: str) -> list[int]:
    if not v or not all(_is_int(t) for t in v):
        raise _bad(f"'{param}' must be a non-empty string, a list of token ids, or a list of those", param)
    bad = [t for t in v if not 0 <= t < ctx.vocab_size]
    if bad:
        raise _bad(
            f"token id {bad[0]} in '{param}' is outside the vocabulary (0..{ctx.vocab_size - 1})", param
        )
    return list(v)


def _encode(ctx: ServeContext, text: str) -> list[int]:
    return list(ctx.tokenizer(text, verbose=False)["input_ids"])  # no warning for over-long prompts


def parse_completion(body, ctx: ServeContext) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = _model(body, ctx)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [prompt]
    else:
        raise _bad(
            "'prompt' is required: a non-empty string, a list of token ids, or a list of those", "prompt"
        )
    encoded = []
    for p in prompts:
        ids = _encode(ctx, p) if isinstance(p, str) else _token_list(p, ctx, "prompt")
        if not ids:
            raise _bad("'prompt' must not be empty", "prompt")
        encoded.append(ids)
    max_tokens = _int(body, "max_tokens", 16, lo=1)
    return _choices("completion", model, encoded, body, max_tokens, ctx, "max_tokens")


def _message_text(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise _bad(
            f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
            f"messages[{i}].role",
        )
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(
            f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
        )
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body, ctx: ServeContext) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = _model(body, ctx)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required: a non-empty list of {role, content} objects", "messages")
    msgs = [_message_text(m, i) for i, m in enumerate(messages)]
    if not getattr(ctx.tokenizer, "chat_template", None):
        raise _bad("this model has no chat template; use /v1/completions with a plain prompt", "messages")
    try:
        out = ctx.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template rejects the conversation (e.g. role order)
        raise _bad(f"the chat template rejected these messages: {e}", "messages") from None
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = _int(body, "max_tokens", None, lo=1), "max_tokens"
    return _choices("chat", model, [ids], body, max_tokens, ctx, param)


# ---- responses ----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(p: ParsedRequest, choices: list[dict], use: dict) -> dict:
    """choices: [{"index", "text", "finish_reason"}]."""
    return {
        "id": f"cmpl-{p.id}",
        "object": "text_completion",
        "created": p.created,
        "model": p.model,
        "choices": [{**c, "logprobs": None} for c in choices],
        "usage": use,
    }


def completion_chunk(p: ParsedRequest, index: int, text: str, finish_reason: str | None) -> dict:
    return {
        "id": f"cmpl-{p.id}",
        "object": "text_completion",
        "created": p.created,
        "model": p.model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_body(p: ParsedRequest, choices: list[dict], use: dict) -> dict:
    return {
        "id": f"chatcmpl-{p.id}",
        "object": "chat.completion",
        "created": p.created,
        "model": p.model,
        "choices": [
            {
                "index": c["index"],
                "message": {"role": "assistant", "content": c["text"]},
                "logprobs": None,
                "finish_reason": c["finish_reason"],
            }
            for c in choices
        ],
        "usage": use,
    }


def chat_chunk(p: ParsedRequest, index: int, delta: dict, finish_reason: str | None) -> dict:
    return {
        "id": f"chatcmpl-{p.id}",
        "object": "chat.completion.chunk",
        "created": p.created,
        "model": p.model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(p: ParsedRequest, use: dict) -> dict:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    prefix = "chatcmpl" if p.kind == "chat" else "cmpl"
    return {
        "id": f"{prefix}-{p.id}",
        "object": obj,
        "created": p.created,
        "model": p.model,
        "choices": [],
        "usage": use,
    }


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
