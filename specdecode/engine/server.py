"""OpenAI-compatible HTTP server (FastAPI on uvicorn) over the serving `Engine`.

Contract:
- `create_app(engine, ctx)` serves `POST /v1/completions`, `POST /v1/chat/completions`
  (server-sent events when `stream` is true, else one JSON body), `GET /v1/models`,
  `GET /v1/models/{id}`, `GET /health` (503 while shutting down) and `GET /metrics`
  (Prometheus text). The engine starts with the app and is shut down with it.
- Every error is an OpenAI error body (`protocol.APIError`): malformed JSON, wrong types and
  impossible values 400, unknown model or route 404, wrong method 405, body over 8 MiB 413,
  queue full 429, shutting down 503, a failure while decoding 500. One request's error never
  affects the others.
- A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its
  requests aborted, which frees their slots between engine steps.
- `serve(...)` builds the engine from a target and a method (`build_engine`) and runs uvicorn;
  SIGINT/SIGTERM first make the engine refuse new requests (503), then in-flight requests get
  up to `shutdown_grace_s` to finish before they are cancelled.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request) at
# run time, and fastapi is imported inside create_app only.
import asyncio
import contextlib
import json
import logging
import time

from specdecode.engine.engine import Engine, EngineClosed, EngineEvent, QueueFull
from specdecode.engine.protocol import (
    APIError,
    ParsedRequest,
    ServeContext,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    parse_chat,
    parse_completion,
    sse,
    usage,
    usage_chunk,
)
from specdecode.errors import SpecDecodeError

log = logging.getLogger("specdecode.server")

MAX_BODY_BYTES = 8 << 20
DISCONNECT_POLL_S = 0.25


def create_app(engine: Engine, ctx: ServeContext, shutdown_grace_s: float = 30.0):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_grace_s)

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics
    created = int(time.time())

    def error_response(e: APIError) -> JSONResponse:
        kind = e.code or e.type
        metrics.inc("specdecode_request_errors_total", status=str(e.status), kind=kind)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, msg.get(e.status_code, str(e.detail)), code=code))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    async def read_json(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None

    def model_card() -> dict:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": created,
            "owned_by": "specdecode",
            "max_model_len": ctx.max_model_len,
        }

    @app.get("/health")
    async def health():
        if engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "running": engine.decoder.num_active, "waiting": engine.num_waiting}

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in ctx.names:
            raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(await read_json(request), ctx)
        return await run(request, parsed)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed = parse_chat(await read_json(request), ctx)
        return await run(request, parsed)

    async def run(request: Request, parsed: ParsedRequest):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(ev: EngineEvent) -> None:  # engine thread -> this request's event loop
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        ids: list[str] = []
        try:
            for req in parsed.requests:
                engine.submit(req, sink)
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

    async def collect(request: Request, parsed: ParsedRequest, ids: list[str], queue) -> dict:
        index = {rid: i for i, rid in enumerate(ids)}
        texts, finish, completion = [""] * len(ids), [None] * len(ids), 0
        pending = set(ids)
        try:
            while pending:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)  # nobody reads it; slots freed below
                    continue
                i = index[ev.request_id]
                texts[i] += ev.text
                if ev.error is not None:
                    raise APIError(
                        503 if ev.error.startswith("cancel") else 500, ev.error, code="decode_failed"
                    )
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
                    err = APIError(
                        503 if ev.error.startswith("cancel") else 500, ev.error, code="decode_failed"
                    )
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


def build_engine(
    target,
    method: str = "ar",
    drafter: str | None = None,
    *,
    num_draft_tokens: int | None = None,
    policy: str = "scheduled",
    dtype: str = "bf16",
    device: str | None = None,
    max_batch: int = 8,
    max_model_len: int | None = None,
    max_queue: int = 64,
    verify_mode: str = "rejection",
    served_model_name: str | None = None,
    drafter_options: dict | None = None,
) -> tuple[Engine, ServeContext]:
    """Load target and drafter, measure what the policy needs, and wrap them in an Engine."""
    import specdecode
    from specdecode.models.loader import load_model

    tgt = load_model(target, dtype=dtype, device=device) if isinstance(target, str) else target
    ctx_len = tgt.model.info.max_position
    length = max_model_len or min(ctx_len, DEFAULT_MAX_MODEL_LEN)
    if not 2 <= length <= ctx_len:
        raise SpecDecodeError(f"--max-model-len must be in 2..{ctx_len} (the model's context), got {length}")
    if max_batch < 1:
        raise SpecDecodeError(f"--max-batch must be >= 1, got {max_batch}")
    sd = specdecode.load(
        tgt,
        method,
        drafter,
        num_draft_tokens=num_draft_tokens,
        policy=policy,
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        verify_mode=verify_mode,
        max_model_len=length,
        drafter_options=drafter_options,
    )
    engine = Engine(sd.decoder, max_batch, length, max_queue)
    name = served_model_name or (target if isinstance(target, str) else tgt.name)
    aliases = tuple(sorted({tgt.name, tgt.path.name, str(tgt.path)} - {name}))
    ctx = ServeContext(name, tgt.tokenizer, tgt.vocab_size, length, aliases=aliases)
    return engine, ctx


DEFAULT_MAX_MODEL_LEN = 4096


def _check_port(host: str, port: int) -> None:
    import socket

    if not 0 <= port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise SpecDecodeError(f"cannot resolve --host {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise SpecDecodeError(
                f"cannot listen on {host}:{port} ({e.strerror}); pass another --port"
            ) from None


def make_server(
    engine: Engine, ctx: ServeContext, host: str, port: int, shutdown_grace_s: float = 30.0, log_level="info"
):
    """A uvicorn Server whose SIGINT/SIGTERM first closes the engine to new requests."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.close()
            super().handle_exit(sig, frame)

    app = create_app(engine, ctx, shutdown_grace_s)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=max(1, int(shutdown_grace_s)),
        access_log=log_level in ("debug", "trace"),
    )
    return _Server(config)


def serve(
    target,
    method: str = "ar",
    drafter: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_grace_s: float = 30.0,
    log_level: str = "info",
    **engine_kwargs,
) -> None:
    """Build the engine and serve until SIGINT / SIGTERM."""
    _check_port(host, port)
    engine, ctx = build_engine(target, method, drafter, **engine_kwargs)
    log.warning(
        "serving %s (method %s, max batch %d, context %d) on http://%s:%d/v1",
        ctx.model_name, method, engine.max_batch, ctx.max_model_len, host, port,
    )  # fmt: skip
    try:
        make_server(engine, ctx, host, port, shutdown_grace_s, log_level).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a clean shutdown
        pass
    log.warning("shut down cleanly")
