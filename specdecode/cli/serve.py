"""`specdecode serve`: the OpenAI-compatible HTTP server with continuous batching.

Contract: the `LoadOptions` flags (policy `scheduled` by default here) plus the server's own:
address, served context and name, queue, shutdown grace, log level, and the HTTP limits
(`engine.limits.ServerLimits`; a limit not given keeps its default). Runs until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse

from specdecode.cli import options

SERVE_POLICY = "scheduled"  # DSpark's admission: the server batches many requests


def add_parsers(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    options.add_load_options(sv)
    sv.set_defaults(policy=SERVE_POLICY, handler=serve)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-model-len", type=int, default=None, help="served context (default <= 4096)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (then 429)")
    sv.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    sv.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds given to in-flight work")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.add_argument(
        "--limit-concurrency", type=int, default=None, help="open connections + requests (256); beyond: 503"
    )
    sv.add_argument("--timeout-keep-alive", type=float, default=None, help="idle keep-alive seconds (5)")
    sv.add_argument("--timeout-header", type=float, default=None, help="seconds for a request head (10)")
    sv.add_argument("--timeout-body", type=float, default=None, help="seconds for a request body (30)")


def serve(a: argparse.Namespace) -> None:
    # Deferred: the server needs the optional fastapi, pydantic and uvicorn (the `serve` extra).
    from specdecode.engine.server import ServerLimits, serve

    given = {
        "limit_concurrency": a.limit_concurrency,
        "keep_alive_s": a.timeout_keep_alive,
        "header_timeout_s": a.timeout_header,
        "body_timeout_s": a.timeout_body,
    }
    serve(
        options.load_options(a),
        host=a.host,
        port=a.port,
        shutdown_grace_s=a.shutdown_grace,
        log_level=a.log_level,
        limits=ServerLimits(**{k: v for k, v in given.items() if v is not None}),
        max_queue=a.max_queue,
        served_model_name=a.served_model_name,
    )
