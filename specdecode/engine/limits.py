"""Limits of the HTTP layer, and what a client may see of the machine.

Contract:
- `ServerLimits` (validated at construction; errors name the `specdecode serve` flag): request
  body size (8 MiB) and body time, request-head time, idle keep-alive time, open connections or
  requests (`limit_concurrency`; beyond: 503), tokenizer threads.
- `BodyGuard`: ASGI middleware enforcing the body limits while the body streams in, chunked or
  not (413 / 408 as soon as a limit is passed, nothing more read).
- `head_timeout_protocol(timeout_s)`: uvicorn's HTTP protocol with a deadline on each request
  head (408, connection closed).
- `check_port(host, port)`: the address can be listened on, else a `SpecDecodeError`.
- `scrub(message, local)`: a client-facing message without local paths; `local_paths(aliases)`
  lists the directories to hide (home, cwd, temp, a model directory).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError

MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class ServerLimits:
    """Per-connection and per-request limits of the HTTP layer."""

    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # the whole request body, from the app's first read
    header_timeout_s: float = 10.0  # request line + headers, from their first byte
    keep_alive_s: float = 5.0  # idle keep-alive connection
    limit_concurrency: int = 256  # open connections or requests; beyond: 503
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        flags = {"limit_concurrency": "--limit-concurrency", "body_timeout_s": "--timeout-body",
                 "header_timeout_s": "--timeout-header", "keep_alive_s": "--timeout-keep-alive"}  # fmt: skip
        for name, lo in [("max_body_bytes", 1), ("limit_concurrency", 1), ("tokenizer_threads", 1),
                         ("body_timeout_s", 0), ("header_timeout_s", 0), ("keep_alive_s", 0)]:  # fmt: skip
            v = getattr(self, name)
            if not (v >= lo if lo else v > 0):
                raise SpecDecodeError(f"{flags.get(name, name)} must be {'>= 1' if lo else '> 0'}, got {v}")


# Absolute paths under the usual roots (a model directory, a cache, a traceback's file names).
_PATH = re.compile(
    r"(?:[A-Za-z]:\\|~/|/(?:home|root|work|tmp|usr|opt|var|etc|mnt|srv|Users|data)/)[^\s\"'<>]*"
)


def scrub(message: str, local: tuple[str, ...] = ()) -> str:
    """A client-facing message without local paths."""
    for p in sorted(local, key=len, reverse=True):
        if len(p) > 1:
            message = message.replace(p, "<path>")
    return _PATH.sub("<path>", message)


def local_paths(aliases: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Local directories an error message could name (the model's, home, cwd, temp)."""
    paths = {str(Path.home()), os.getcwd(), tempfile.gettempdir()}
    paths |= {a for a in aliases if os.sep in a and os.path.exists(a)}
    return tuple(p for p in paths if p not in ("", "/"))


class BodyGuard:
    """ASGI middleware: the request body may not exceed max_bytes nor take over timeout_s.

    Content-Length over the limit is refused before anything is read; otherwise bytes are
    counted as they arrive (chunked transfer too) and the read that passes the limit, or the
    deadline, raises an HTTPException (413 / 408), which FastAPI's body reader passes through to
    the app's error handler. After the body the receive channel is untouched (disconnects)."""

    def __init__(self, app, max_bytes: int, timeout_s: float, reject):
        # Deferred: starlette comes with the optional fastapi (the `serve` extra).
        from starlette.exceptions import HTTPException

        self.app, self.max_bytes, self.timeout_s, self.reject = app, max_bytes, timeout_s, reject
        self.http_exception = HTTPException

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.reject(413)(scope, receive, send)
        seen, done, deadline = 0, False, None

        async def guarded():
            nonlocal seen, done, deadline
            if done:
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout_s
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                done = True
                raise self.http_exception(408) from None
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                done = True
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                done = True
                raise self.http_exception(413)
            return msg

        await self.app(scope, guarded, send)


def head_timeout_protocol(timeout_s: float):
    """uvicorn's HTTP protocol plus a deadline on each request head: uvicorn bounds an idle
    keep-alive connection, not one that sends nothing or trickles its head in."""
    # Deferred: uvicorn is an optional dependency (the `serve` extra).
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadTimeoutProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request head was parsed
                self._disarm()
            elif self._head_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of the next head on a kept-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._expire, self.cycle)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self, cycle) -> None:
            self._head_timer = None
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
                )
                self.transport.close()

    return HeadTimeoutProtocol


def check_port(host: str, port: int) -> None:
    """Refuse, with the flag to change, an address this process cannot listen on."""
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
