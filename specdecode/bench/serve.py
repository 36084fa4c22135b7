"""Drive a running `specdecode serve` over loopback: server process, load levels, metrics scrape.

Contract:
- `ServerProcess(args, port)` starts `python -m specdecode.cli serve ...` as a child process,
  waits for `/health`, and on exit stops it with SIGINT (graceful shutdown) and records its
  exit code (`returncode`); its log goes to `log_path`.
- `run_level(url, model, prompts, concurrency, num_requests, max_tokens, temperature)` keeps
  `concurrency` streaming chat requests in flight until `num_requests` have finished; each
  request is timed client-side (start, first token, end, completion tokens from the usage
  chunk). Returns `LevelResult`: throughput (completion tokens / wall time of the level),
  per-user tokens/s (median over requests of (tokens - 1) / (end - first token)), time to first
  token (median, p90), end-to-end latency, error count.
- `scrape(url)` parses `/metrics` into {series: value}; `tau_acceptance(before, after)` gives
  tau and acceptance over an interval from two scrapes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


class ServerProcess:
    def __init__(self, args: list[str], port: int, log_path: str | Path, startup_timeout: float = 900.0):
        self.args, self.port, self.log_path = args, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.startup_timeout = startup_timeout
        self.returncode: int | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "specdecode.cli", "serve", *self.args, "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.time() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not become healthy; see {self.log_path}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode if self.proc else None
        self._log.close()


@dataclass
class RequestTiming:
    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    wall_s: float
    completion_tokens: int
    throughput: float  # completion tokens / s over the level
    per_user_tps: float  # median (tokens - 1) / (end - first token)
    ttft_p50_s: float
    ttft_p90_s: float
    latency_p50_s: float
    errors: int
    tau: float | None = None
    acceptance: float | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    t = RequestTiming(start=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                t.error = f"HTTP {r.status_code}"
                return t
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    t.error = obj["error"].get("message", "error")
                    break
                if obj.get("usage"):
                    t.tokens = obj["usage"]["completion_tokens"]
                for c in obj.get("choices", []):
                    if c.get("delta", {}).get("content") and t.first is None:
                        t.first = time.perf_counter()
    except httpx.HTTPError as e:
        t.error = f"{type(e).__name__}: {e}"
    t.end = time.perf_counter()
    return t


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _level(url, model, prompts, concurrency, num_requests, max_tokens, temperature) -> LevelResult:
    todo = asyncio.Queue()
    for i in range(num_requests):
        todo.put_nowait(i)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker():
            while True:
                try:
                    i = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {
                    "model": model,
                    "messages": prompts[i % len(prompts)],
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": i,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                timings.append(await _one(client, url, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [t for t in timings if t.error is None and t.first is not None]
    tokens = sum(t.tokens for t in ok)
    per_user = [(t.tokens - 1) / (t.end - t.first) for t in ok if t.tokens > 1 and t.end > t.first]
    ttft = [t.first - t.start for t in ok]
    return LevelResult(
        concurrency=concurrency,
        num_requests=num_requests,
        wall_s=wall,
        completion_tokens=tokens,
        throughput=tokens / wall if wall > 0 else 0.0,
        per_user_tps=statistics.median(per_user) if per_user else 0.0,
        ttft_p50_s=_quantile(ttft, 0.5),
        ttft_p90_s=_quantile(ttft, 0.9),
        latency_p50_s=_quantile([t.end - t.start for t in ok], 0.5),
        errors=len(timings) - len(ok),
    )


def run_level(url, model, prompts, concurrency, num_requests, max_tokens=64, temperature=0.0) -> LevelResult:
    return asyncio.run(_level(url, model, prompts, concurrency, num_requests, max_tokens, temperature))


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def tau_acceptance(before: dict, after: dict) -> tuple[float | None, float | None]:
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    rows, drafted = delta("specdecode_verify_rows_total"), delta("specdecode_draft_tokens_total")
    tau = delta("specdecode_emitted_tokens_total") / rows if rows else None
    acc = delta("specdecode_accepted_tokens_total") / drafted if drafted else None
    return tau, acc
