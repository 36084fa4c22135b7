"""OpenAI-compatible HTTP server (FastAPI on uvicorn) over the serving `Engine`.

Contract:
- `create_app(engine, ctx, shutdown_grace_s, limits)` serves `POST /v1/completions` and
  `POST /v1/chat/completions` (server-sent events when `stream` is true, else one JSON body;
  bodies are `protocol`'s pydantic models), `GET /v1/models[/{id}]`, `GET /health` (503 while
  shutting down), `GET /metrics` (prometheus_client) and `GET /openapi.json`. The engine starts
  and stops with the app.
- Per request, cheapest first: body size (`ServerLimits.max_body_bytes`, 8 MiB) and body time
  (`body_timeout_s`) while the body streams in, chunked or not (413 / 408 as soon as a limit is
  passed, nothing more read, connection closed); JSON and parameters (pydantic);
  `protocol.precheck`; then tokenization in a small thread pool off the event loop; the engine,
  whose admission takes the connection as the client to be fair to (round robin between them).
- Errors are OpenAI error bodies: malformed JSON (also too deep or a number too long), wrong types
  and impossible values 400, unknown model or route 404, wrong method 405, slow body 408, large
  body 413, queue full 429, shutting down 503, a failure while decoding 500. Their messages never
  carry a traceback, an internal exception's text or a local path (`limits.scrub`): details go to the
  log. One request's error never affects the others.
- A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
  requests aborted, which frees their slots between engine steps.
- `make_server(...)`: uvicorn with per-connection limits: a request head must arrive within
  `header_timeout_s` of its first byte (or of the connection's opening), an idle keep-alive
  connection closes after `keep_alive_s`, past `limit_concurrency` open connections or requests
  uvicorn answers 503 (plain text). SIGINT/SIGTERM first make the engine refuse new requests
  (503), then in-flight requests get `shutdown_grace_s` to finish before they are cancelled.
- `build_engine(options, max_queue, served_model_name)` builds the model pair from a
  `build.LoadOptions` and wraps it in an `Engine`; `serve(options, host=, port=, ...)` builds the
  engine and runs the server until SIGINT / SIGTERM. The HTTP limits live in `engine/limits.py`,
  request models and planning in `engine/protocol.py`, response bodies in `engine/responses.py`.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time.
import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from specdecode.build import LoadOptions, build
from specdecode.engine.engine import Engine, EngineClosed, EngineEvent, QueueFull
from specdecode.engine.limits import (
    BodyGuard,
    ServerLimits,
    check_port,
    head_timeout_protocol,
    local_paths,
    scrub,
)
from specdecode.engine.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ErrorBody,
    ParsedRequest,
    ServeContext,
    plan,
    precheck,
    prompt_char_limit,
    validation_error,
)
from specdecode.engine.responses import (
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    sse,
    usage,
    usage_chunk,
)
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model

__all__ = ["ServerLimits", "build_engine", "create_app", "make_server", "serve"]

log = logging.getLogger("specdecode.server")

DISCONNECT_POLL_S = 0.25
DEFAULT_MAX_MODEL_LEN = 4096


def create_app(
    engine: Engine, ctx: ServeContext, shutdown_grace_s: float = 30.0, limits: ServerLimits | None = None
):
    # Deferred: fastapi is an optional dependency (the `serve` extra).
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or ServerLimits()
    pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="specdecode-tokenize")
    local = local_paths(ctx.aliases)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_grace_s)
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = _openapi(app, ctx)
    metrics = engine.metrics

    def error_response(e: APIError) -> JSONResponse:
        kind = e.code or e.type
        metrics.inc("specdecode_request_errors_total", status=str(e.status), kind=kind)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
        if e.status in (408, 413):  # the rest of the body is not read: the connection cannot be reused
            headers["Connection"] = "close"
        body = e.body()
        body["error"]["message"] = scrub(e.message, local)
        return JSONResponse(body, status_code=e.status, headers=headers)

    def http_error(status: int, request=None) -> APIError:
        path = request.url.path if request is not None else ""
        messages = {
            400: ("the request body is not valid JSON (malformed, nested too deeply, or a number too long)",
                  "invalid_json"),
            404: (f"no route {path[:100]}", "not_found"),
            405: (f"method {request.method if request else ''} not allowed here", "method_not_allowed"),
            408: (f"the request body took over {limits.body_timeout_s:g} s to arrive", "body_timeout"),
            413: (f"request body over {limits.max_body_bytes} bytes", "body_too_large"),
        }  # fmt: skip
        message, code = messages.get(status, (f"HTTP error {status}", None))
        return APIError(status, message, code=code)

    app.add_middleware(
        BodyGuard,
        max_bytes=limits.max_body_bytes,
        timeout_s=limits.body_timeout_s,
        reject=lambda status: error_response(http_error(status)),
    )

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e):
        return error_response(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return error_response(http_error(e.status_code, request))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error")
        return error_response(APIError(500, "internal error; see the server log", code="internal_error"))

    card = {"id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "specdecode"}
    card["max_model_len"] = ctx.max_model_len

    def errors(*codes) -> dict:
        return {c: {"model": ErrorBody, "description": ERRORS[c]} for c in codes}

    @app.get("/health", responses={503: {"description": "shutting down"}})
    async def health():
        if engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "running": engine.decoder.num_active, "waiting": engine.num_waiting}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", responses=errors(404))
    async def get_model(model_id: str):
        if model_id not in ctx.names:
            raise APIError(404, "The model does not exist (GET /v1/models)", "model", "model_not_found")
        return card

    @app.post("/v1/completions", responses=errors(*ERRORS) | STREAM)
    async def completions(body: CompletionRequest, request: Request):
        return await run(request, body)

    @app.post("/v1/chat/completions", responses=errors(*ERRORS) | STREAM)
    async def chat_completions(body: ChatRequest, request: Request):
        return await run(request, body)

    async def run(request: Request, body):
        precheck(body, ctx)  # cheap checks first: tokenizing is the expensive part
        loop = asyncio.get_running_loop()
        parsed = await loop.run_in_executor(pool, plan, body, ctx)
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(ev: EngineEvent) -> None:  # engine thread -> this request's event loop
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        ids: list[str] = []
        conn = request.client  # fairness unit: the connection (host, port); None in some test clients
        client = ("connection", conn.host, conn.port) if conn else ("request", parsed.id)
        try:
            for req in parsed.requests:
                engine.submit(req, sink, client)
                ids.append(req.id)
        except (QueueFull, EngineClosed, SpecDecodeError) as e:
            for rid in ids:
                engine.abort(rid)
            status = 429 if isinstance(e, QueueFull) else 503 if isinstance(e, EngineClosed) else 400
            code = {429: "queue_full", 503: "shutting_down", 400: "invalid_request"}[status]
            raise APIError(status, str(e), code=code) from None
        if parsed.stream:
            return StreamingResponse(
                stream_events(parsed, ids, queue),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await collect(request, parsed, ids, queue)

    def event_error(ev: EngineEvent) -> APIError:
        if ev.error.startswith("cancel"):
            return APIError(503, "the request was cancelled: the server is shutting down", code="cancelled")
        log.warning("request %s failed: %s", ev.request_id, ev.error)
        return APIError(
            500, "internal error while decoding this request; see the server log", code="decode_failed"
        )

    async def collect(request: Request, parsed: ParsedRequest, ids: list[str], queue) -> dict:
        index = {rid: i for i, rid in enumerate(ids)}
        texts, finish, completion = [""] * len(ids), [None] * len(ids), 0
        pending, loop = set(ids), asyncio.get_running_loop()
        next_poll = loop.time() + DISCONNECT_POLL_S
        try:
            while pending:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=max(0.0, next_poll - loop.time()))
                except TimeoutError:
                    ev = None
                if loop.time() >= next_poll:  # on time, however fast tokens arrive
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)  # nobody reads it; slots freed below
                    next_poll = loop.time() + DISCONNECT_POLL_S
                if ev is None:
                    continue
                i = index[ev.request_id]
                texts[i] += ev.text
                if ev.error is not None:
                    pending.discard(ev.request_id)
                    raise event_error(ev)
                if ev.result is not None:
                    pending.discard(ev.request_id)
                    finish[i] = ev.result.finish_reason
                    completion += ev.result.num_new_tokens
        finally:
            for rid in pending:
                engine.abort(rid)
        choices = [
            {"index": i, "text": t, "finish_reason": f}
            for i, (t, f) in enumerate(zip(texts, finish, strict=True))
        ]
        use = usage(parsed.num_prompt_tokens, completion)
        return (
            chat_body(parsed, choices, use)
            if parsed.kind == "chat"
            else completion_body(parsed, choices, use)
        )

    async def stream_events(parsed: ParsedRequest, ids: list[str], queue):
        index = {rid: i for i, rid in enumerate(ids)}
        pending, completion = set(ids), 0
        chat = parsed.kind == "chat"
        try:
            if chat:
                for i in range(len(ids)):
                    yield sse(chat_chunk(parsed, i, {"role": "assistant", "content": ""}, None))
            while pending:
                ev = await queue.get()
                i = index[ev.request_id]
                if ev.error is not None:
                    pending.discard(ev.request_id)
                    err = event_error(ev)
                    metrics.inc("specdecode_request_errors_total", status=str(err.status), kind=err.code)
                    yield sse(err.body())
                    break
                if ev.text:
                    yield sse(
                        chat_chunk(parsed, i, {"content": ev.text}, None)
                        if chat
                        else completion_chunk(parsed, i, ev.text, None)
                    )
                if ev.result is not None:
                    pending.discard(ev.request_id)
                    completion += ev.result.num_new_tokens
                    reason = ev.result.finish_reason
                    yield sse(
                        chat_chunk(parsed, i, {}, reason) if chat else completion_chunk(parsed, i, "", reason)
                    )
            if not pending and parsed.include_usage:
                yield sse(usage_chunk(parsed, usage(parsed.num_prompt_tokens, completion)))
            yield "data: [DONE]\n\n"
        finally:  # client gone (the task is cancelled) or an error: free the slots
            for rid in pending:
                engine.abort(rid)

    return app


ERRORS = {
    400: "malformed JSON, wrong types, impossible values, or more tokens than the context holds",
    404: "unknown model",
    408: "the body arrived too slowly",
    413: "the body is over the size limit",
    429: "the queue is full; retry later",
    500: "decoding failed",
    503: "shutting down",
}
STREAM = {
    200: {
        "description": "JSON, or server-sent events when stream is true",
        "content": {"text/event-stream": {}},
    }
}


def _openapi(app, ctx: ServeContext):
    """The schema FastAPI generates, made true to this server: validation errors are 400 (as
    OpenAI's), not FastAPI's 422, and `model` names the served model."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for ops in schema["paths"].values():
                for op in ops.values():
                    op["responses"].pop("422", None)
            for name in ("CompletionRequest", "ChatRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [ctx.model_name]
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def build_engine(
    options: LoadOptions, *, max_queue: int = 64, served_model_name: str | None = None
) -> tuple[Engine, ServeContext]:
    """Load target and drafter (`options`), measure what the policy needs, and wrap them in an
    Engine serving contexts of `options.max_model_len` tokens (default: the model's, at most 4096).

    Without `served_model_name` a target given as a local directory is served under the
    directory's name (its full path stays accepted as `model` but is never shown to clients)."""
    given = options.target
    tgt = load_model(given, dtype=options.dtype, device=options.device) if isinstance(given, str) else given
    ctx_len = tgt.model.info.max_position
    length = options.max_model_len or min(ctx_len, DEFAULT_MAX_MODEL_LEN)
    if not 2 <= length <= ctx_len:
        raise SpecDecodeError(f"--max-model-len must be in 2..{ctx_len} (the model's context), got {length}")
    if options.max_batch < 1:
        raise SpecDecodeError(f"--max-batch must be >= 1, got {options.max_batch}")
    sd = build(dataclasses.replace(options, target=tgt, max_model_len=length))
    engine = Engine(sd.decoder, options.max_batch, length, max_queue)
    given = given if isinstance(given, str) else tgt.name
    name = served_model_name or (tgt.path.name if os.path.exists(given) else given)
    aliases = tuple(sorted({tgt.name, tgt.path.name, str(tgt.path)} - {name}))
    chars = prompt_char_limit(tgt.tokenizer, length)
    ctx = ServeContext(name, tgt.tokenizer, tgt.vocab_size, length, aliases=aliases, max_prompt_chars=chars)
    return engine, ctx


def make_server(
    engine: Engine,
    ctx: ServeContext,
    host: str,
    port: int,
    shutdown_grace_s: float = 30.0,
    log_level="info",
    limits: ServerLimits | None = None,
):
    """A uvicorn Server whose SIGINT/SIGTERM first closes the engine to new requests."""
    # Deferred: uvicorn is an optional dependency (the `serve` extra).
    import uvicorn

    limits = limits or ServerLimits()

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.close()
            super().handle_exit(sig, frame)

    app = create_app(engine, ctx, shutdown_grace_s, limits)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=head_timeout_protocol(limits.header_timeout_s),
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=limits.limit_concurrency,
        log_level=log_level,
        timeout_graceful_shutdown=max(1, int(shutdown_grace_s)),
        access_log=log_level in ("debug", "trace"),
    )
    return _Server(config)


def serve(
    options: LoadOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_grace_s: float = 30.0,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    max_queue: int = 64,
    served_model_name: str | None = None,
) -> None:
    """Build the engine and serve until SIGINT / SIGTERM."""
    check_port(host, port)
    engine, ctx = build_engine(options, max_queue=max_queue, served_model_name=served_model_name)
    log.warning(
        "serving %s (method %s, max batch %d, context %d) on http://%s:%d/v1",
        ctx.model_name, options.method, engine.max_batch, ctx.max_model_len, host, port,
    )  # fmt: skip
    try:
        make_server(engine, ctx, host, port, shutdown_grace_s, log_level, limits).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a clean shutdown
        pass
    log.warning("shut down cleanly")
