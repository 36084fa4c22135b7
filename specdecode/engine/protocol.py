"""OpenAI-compatible request models (pydantic) and request planning.

Contract:
- `CompletionRequest` and `ChatRequest` are the bodies of `/v1/completions` and
  `/v1/chat/completions`, validated by FastAPI with strict types (no "12" for an integer, no 1
  for a boolean, no "NaN" for a number; 16.0 is an integer); unknown fields are ignored.
  `validation_error(errors)` turns pydantic's errors into one `APIError` 400 naming the
  parameter (code `invalid_json` for a body that is not JSON).
- Sampling: temperature in [0, 2], top_p in (0, 1], top_k >= -1 (0 and -1 disable it); NaN and
  infinities are refused, tiny positive values are valid (`config.SamplingParams` makes a
  temperature below `MIN_TEMPERATURE` greedy and a top_p below fp32's smallest mass keep the top
  token). `stop`: up to `MAX_STOP` strings of 1..`MAX_STOP_CHARS` characters. Text must be valid
  Unicode (an unpaired surrogate, sent as a JSON escape, is a 400, not a tokenizer crash).
  Parameters this server cannot honour losslessly (penalties, logit bias, logprobs, tools, echo,
  suffix) are a 400 naming the parameter.
- `precheck(req, ctx)`: the cheap checks that need the served model: the model name (404), the
  number of choices, token ids inside the vocabulary, a max_tokens or a prompt text that cannot
  fit (400 `context_length_exceeded`; `prompt_char_limit` bounds the characters a context holds,
  so a huge prompt is refused untokenized). `plan(req, ctx)` then tokenizes (slow: run it off the
  event loop) and returns a `ParsedRequest`: one `GenerationRequest` per choice (prompt-major,
  then the `n` samples of a prompt, as OpenAI numbers choices), stream flags, prompt token counts;
  a prompt over the context, or prompt + max_tokens over it, is 400 `context_length_exceeded`.
- Every error is an `APIError` with the HTTP status and OpenAI's body (`{"error": {"message",
  "type", "param", "code"}}`); a message echoes at most a short prefix of what the client sent.
- Defaults follow OpenAI: temperature 1, top_p 1; completions 16 new tokens, chat the rest of the
  context. `top_k` and `ignore_eos` are extensions. Without `seed` a request gets a random one;
  choice j > 0 of a seeded request uses `derive_seed(seed, j)`, so a seed reproduces `n` samples.
- The responses are built in `engine/responses.py`.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, field_validator

from specdecode.chat import derive_seed
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.request import GenerationRequest

MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_CHOICES = 16  # prompts x n per request
MAX_MODEL_NAME = 512
ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_RANGE = (-(2**63), 2**64)  # OpenAI's seeds are 64-bit; all 64 bits reach the generator


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            408: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _short(v, n: int = 64) -> str:
    """A client's value in an error message: JSON (ASCII, so never an unpaired surrogate), cut."""
    s = json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---- request models -----------------------------------------------------------------------
def _integral(v):
    # JSON writers that only know doubles send 16.0 for 16.
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _int(**bounds):
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _real(**bounds):
    return Annotated[float, Field(allow_inf_nan=False, **bounds)]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SURROGATE = re.compile("[\ud800-\udfff]")  # what a JSON escape such as \uD800 decodes to


def _text(v) -> bool:
    """A non-empty string that is valid Unicode (no unpaired surrogate: tokenizers refuse them)."""
    return isinstance(v, str) and len(v) > 0 and (v.isascii() or not _SURROGATE.search(v))


def _is_ids(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_int(t) for t in v)


def _prompts(v) -> list[str | list[int]]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(v, str) or _is_ids(v):
        v = [v]
    if isinstance(v, list) and 0 < len(v) <= MAX_CHOICES and all(_text(p) or _is_ids(p) for p in v):
        return v
    raise ValueError(
        f"must be a non-empty string, a list of token ids, or a list of up to {MAX_CHOICES} of those "
        "(text must be valid Unicode)"
    )


def _stop(v) -> tuple[str, ...]:
    if v is None:
        return ()
    v = [v] if isinstance(v, str) else v
    if (
        not isinstance(v, list)
        or not 0 < len(v) <= MAX_STOP
        or not all(_text(s) and len(s) <= MAX_STOP_CHARS for s in v)
    ):
        raise ValueError(
            f"must be a string or a list of up to {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters"
        )
    return tuple(v)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal[ROLES]
    content: Any = Field(None, validate_default=True)  # text, text parts, or null for an assistant

    @field_validator("content", mode="plain", json_schema_input_type=str | list[TextPart] | None)
    @classmethod
    def _content(cls, v, info) -> str:
        if v is None and info.data.get("role") == "assistant":
            return ""
        if isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v
        ):
            v = "".join(p["text"] for p in v)
        if isinstance(v, str) and (v == "" or _text(v)):
            return v
        raise ValueError(
            "must be a string or a list of text parts ({'type': 'text', 'text': ...}) of valid Unicode"
        )


class _Request(_Body):
    """Fields both endpoints share."""

    model: Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME)]
    n: _int(ge=1, le=MAX_CHOICES) | None = None
    best_of: _int(ge=1, le=MAX_CHOICES) | None = None
    temperature: _real(ge=0.0, le=2.0) | None = None
    top_p: _real(gt=0.0, le=1.0) | None = None
    top_k: _int(ge=-1) | None = None
    seed: _int() | None = None
    stop: Annotated[
        tuple[str, ...], PlainValidator(_stop, json_schema_input_type=str | list[str] | None)
    ] = ()
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    # Accepted at their neutral value only: anything else would change the distribution.
    presence_penalty: _real() | None = None
    frequency_penalty: _real() | None = None
    repetition_penalty: _real() | None = None
    min_p: _real() | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: _int(ge=0) | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not SEED_RANGE[0] <= v < SEED_RANGE[1]:
            raise ValueError("must be a 64-bit integer")
        return v

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    @classmethod
    def _neutral(cls, v, info):
        if v not in (None, 0) and not (info.field_name == "repetition_penalty" and v == 1):
            raise ValueError("is not supported by this server (decoding is lossless); leave it at 0")
        return v

    @field_validator(
        "logit_bias", "top_logprobs", "tools", "functions", "logprobs", "echo", "suffix", check_fields=False
    )
    @classmethod
    def _unsupported(cls, v):
        if v:
            raise ValueError("is not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported")
        return v


class CompletionRequest(_Request):
    prompt: Annotated[
        list[str | list[int]],
        PlainValidator(_prompts, json_schema_input_type=str | list[int] | list[str] | list[list[int]]),
    ]
    max_tokens: _int(ge=1) | None = None
    logprobs: _int(ge=0, le=5) | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: _int(ge=1) | None = None
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: bool | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):  # every error answer (documents the OpenAPI schema)
    error: ErrorDetail


def validation_error(errors: Sequence[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors -> one OpenAI 400 naming the first bad field."""
    if not errors:
        return _bad("invalid request body")
    e = errors[0]
    loc = list(e.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if e.get("type") == "json_invalid":
        reason = (e.get("ctx") or {}).get("error", "")
        return _bad(f"the request body is not valid JSON ({_short(reason)[1:-1]})", code="invalid_json")
    if not loc:
        return _bad("the request body must be a JSON object, sent with Content-Type: application/json")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if e.get("type") == "missing":
        return _bad(f"'{param}' is required", param)
    msg = str(e.get("msg", "is invalid")).removeprefix("Value error, ").removeprefix("Input ")
    return _bad(f"'{param}' {msg[:1].lower() + msg[1:]}", param)


# ---- planning -----------------------------------------------------------------------------
@dataclass
class ServeContext:
    """What request planning needs to know about the served model.

    max_prompt_chars: more characters of prompt text than this cannot fit in the context (see
    `prompt_char_limit`); such a prompt is refused without tokenizing it (None: no such bound)."""

    model_name: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    aliases: tuple[str, ...] = ()
    max_choices: int = MAX_CHOICES
    max_prompt_chars: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)


def prompt_char_limit(tokenizer, max_model_len: int) -> int | None:
    """Characters of text that `max_model_len` tokens can cover at most, or None if unknown.

    A vocabulary entry is at least as long as the text it stands for (byte-level entries spell
    each byte with one symbol, SentencePiece ones spell a space as one), so n tokens cover at most
    n x the longest entry. A normalizer can shrink text (e.g. NFC composing up to 3 characters into
    one), hence the margin of 4 when the tokenizer has one."""
    try:
        longest = max(len(s) for s in tokenizer.get_vocab())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        normalizer = backend.normalizer if backend is not None else True
    except Exception:  # not a Hugging Face tokenizer: no bound
        return None
    return max_model_len * longest * (1 if normalizer is None else 4)


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


def _max_tokens(req: CompletionRequest | ChatRequest) -> tuple[int | None, str]:
    if isinstance(req, CompletionRequest):
        return (16 if req.max_tokens is None else req.max_tokens), "max_tokens"
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def precheck(req: CompletionRequest | ChatRequest, ctx: ServeContext) -> None:
    """The cheap checks that need the served model; raises APIError."""
    if req.model not in ctx.names:
        raise APIError(
            404,
            f"The model {_short(req.model)} does not exist; this server serves '{ctx.model_name}' "
            "(GET /v1/models)",
            "model",
            "model_not_found",
        )
    n = req.n or 1
    num_prompts = len(req.prompt) if isinstance(req, CompletionRequest) else 1
    if num_prompts * n > ctx.max_choices:
        raise _bad(f"at most {ctx.max_choices} choices per request (prompts x n), got {num_prompts * n}", "n")
    if req.best_of not in (None, n):
        raise _bad("'best_of' other than n is not supported", "best_of")
    if isinstance(req, CompletionRequest):
        for p in req.prompt:
            bad = [t for t in p if not 0 <= t < ctx.vocab_size] if isinstance(p, list) else []
            if bad:
                raise _bad(
                    f"token id {_short(bad[0])} in 'prompt' is outside the vocabulary "
                    f"(0..{ctx.vocab_size - 1})",
                    "prompt",
                )
    elif not getattr(ctx.tokenizer, "chat_template", None):
        raise _bad("this model has no chat template; use /v1/completions with a plain prompt", "messages")
    if isinstance(req, CompletionRequest):
        chars, param = max(len(p) if isinstance(p, str) else 0 for p in req.prompt), "prompt"
    else:
        chars, param = sum(len(m.content) for m in req.messages), "messages"
    if ctx.max_prompt_chars is not None and chars > ctx.max_prompt_chars:
        raise _overflow(ctx, f"at most {ctx.max_prompt_chars} characters; your prompt has {chars}.", param)
    max_tokens, param = _max_tokens(req)
    if max_tokens is not None and max_tokens >= ctx.max_model_len:  # a prompt has at least one token
        raise _overflow(ctx, f"{param} must be below that (got {_short(max_tokens, 24)}).", param)


def _overflow(ctx: ServeContext, detail: str, param: str) -> APIError:
    msg = f"This model's maximum context length is {ctx.max_model_len} tokens, {detail}"
    return _bad(msg, param, "context_length_exceeded")


def _check_length(n_prompt: int, max_tokens: int | None, ctx: ServeContext, param: str) -> int:
    if n_prompt >= ctx.max_model_len:
        prompt = "messages" if param == "max_completion_tokens" else "prompt"
        raise _overflow(ctx, f"your prompt has {n_prompt} tokens. Shorten the prompt.", prompt)
    if max_tokens is None:
        return ctx.max_model_len - n_prompt
    if n_prompt + max_tokens > ctx.max_model_len:
        raise _overflow(
            ctx,
            f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
            f"completion). Lower {param} to at most {ctx.max_model_len - n_prompt} or shorten the prompt.",
            param,
        )
    return max_tokens


def _encode(ctx: ServeContext, text: str) -> list[int]:
    return list(ctx.tokenizer(text, verbose=False)["input_ids"])  # no warning for over-long prompts


def _chat_ids(req: ChatRequest, ctx: ServeContext) -> list[int]:
    msgs = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in req.messages
    ]
    try:
        out = ctx.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except TemplateError as e:  # the template's own refusal, e.g. roles out of order
        raise _bad(
            f"the chat template rejected these messages: {_short(str(e), 200)[1:-1]}", "messages"
        ) from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def plan(req: CompletionRequest | ChatRequest, ctx: ServeContext) -> ParsedRequest:
    """Tokenize (slow: run it off the event loop) and build one GenerationRequest per choice."""
    if isinstance(req, CompletionRequest):
        kind, prompts = "completion", [_encode(ctx, p) if isinstance(p, str) else p for p in req.prompt]
        if not all(prompts):
            raise _bad("'prompt' must not be empty", "prompt")
    else:
        kind, prompts = "chat", [_chat_ids(req, ctx)]
    max_tokens, param = _max_tokens(req)
    n = req.n or 1
    t = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    try:
        params = SamplingParams(temperature=t, top_k=max(req.top_k or 0, 0), top_p=top_p)
    except SpecDecodeError as e:  # the pydantic bounds should make this unreachable
        raise _bad(str(e)) from None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stream = bool(req.stream)  # the answer names the served model, not the alias the client used
    parsed = ParsedRequest(kind, ctx.model_name, [], [], stream=stream, include_usage=include_usage, n=n)
    for p, ids in enumerate(prompts):
        budget = _check_length(len(ids), max_tokens, ctx, param)
        for j in range(n):
            index = p * n + j
            if req.seed is None:
                s = secrets.randbits(63)
            else:
                s = req.seed if index == 0 else derive_seed(req.seed, index)
            parsed.requests.append(
                GenerationRequest(
                    list(ids),
                    params,
                    budget,
                    req.stop,
                    s,
                    id=f"{parsed.id}-{index}",
                    ignore_eos=bool(req.ignore_eos),
                )
            )
            parsed.prompt_tokens.append(len(ids))
    return parsed
