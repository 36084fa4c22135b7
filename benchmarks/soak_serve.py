"""Soak test of `specdecode serve`: many clients, hundreds of requests, bad inputs and disconnects.

A server runs as a child process; `--clients` concurrent clients send `--requests` requests in
all, each of a random kind: good completions and chats (plain, streamed, n > 1, stop strings,
random sampling parameters), malformed JSON, unknown model, wrong types, impossible values,
prompts over the context, too many tokens, unsupported parameters, unknown routes, and clients
that disconnect mid-stream or before the first token. Every response is checked against what
its kind must get (good -> 200, or 429 when the queue is full; bad -> the expected 4xx with an
OpenAI error body). At the end: the server must be alive and healthy, hold no request (zero
leaked slots: running 0, queue 0, all slots free), and shut down cleanly on SIGINT.
Writes report.md and results.json.

    OMP_NUM_THREADS=1 python benchmarks/soak_serve.py                 # SmolLM2-135M, a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdecode.bench.datasets import load_categories
from specdecode.bench.serve import ServerProcess, scrape

MODEL = "soak"
MAX_RETRIES = 8  # a good request that gets 429 (queue full) is retried with backoff (<= 8 s)

LOG_DIR = Path(tempfile.gettempdir()) / "specdecode-serve-logs"  # server logs (not committed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kinds(prompts: list[list[dict]], max_len: int):
    """kind -> (weight, builder(rng) -> (path, body or raw bytes, expected statuses))."""

    def chat(rng, **kw):
        body = {"model": MODEL, "messages": rng.choice(prompts), "max_tokens": rng.randint(4, 24)}
        return {**body, **kw}

    def sampling(rng):
        return {
            "temperature": rng.choice([0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": rng.randint(0, 9),
        }

    good = (200, 429)
    c, cc = "/v1/completions", "/v1/chat/completions"
    return {
        "chat": (8, lambda r: (cc, chat(r, **sampling(r)), good)),
        "chat-stream": (8, lambda r: (cc, chat(r, stream=True, **sampling(r)), good)),
        "completion": (
            5,
            lambda r: (c, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16}, good),
        ),
        "completion-stream-n2": (
            3,
            lambda r: (
                c,
                {"model": MODEL, "prompt": "def add(a, b):", "n": 2, "max_tokens": 12, "stream": True},
                good,
            ),
        ),
        "stop-string": (2, lambda r: (cc, chat(r, stop=["\n", "."]), good)),
        "disconnect-mid-stream": (
            5,
            lambda r: (cc, chat(r, stream=True, max_tokens=200, ignore_eos=True), good),
        ),
        "disconnect-early": (3, lambda r: (cc, chat(r, stream=False, max_tokens=200, ignore_eos=True), good)),
        "malformed-json": (2, lambda r: (cc, b'{"model": "soak", "messages": [', (400,))),
        "not-an-object": (1, lambda r: (c, b"[1, 2, 3]", (400,))),
        "unknown-model": (2, lambda r: (c, {"model": "gpt-9", "prompt": "hi"}, (404,))),
        "wrong-type": (2, lambda r: (c, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, (400,))),
        "impossible-value": (
            2,
            lambda r: (
                c,
                {"model": MODEL, "prompt": "hi", r.choice(["temperature", "top_p", "n"]): -1},
                (400,),
            ),
        ),
        "prompt-too-long": (1, lambda r: (c, {"model": MODEL, "prompt": "word " * (2 * max_len)}, (400,))),
        "too-many-tokens": (
            2,
            lambda r: (c, {"model": MODEL, "prompt": "hi", "max_tokens": 10 * max_len}, (400,)),
        ),
        "unsupported": (1, lambda r: (c, {"model": MODEL, "prompt": "hi", "frequency_penalty": 0.5}, (400,))),
        "bad-messages": (
            1,
            lambda r: (cc, {"model": MODEL, "messages": [{"role": "x", "content": 1}]}, (400,)),
        ),
        "unknown-route": (1, lambda r: ("/v1/engines", {"model": MODEL}, (404,))),
    }


async def _send(client, url, kind, path, body, rng) -> tuple[int | None, str]:
    """Returns (status, problem) where problem is '' when the response had the right shape."""
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    if kind == "disconnect-early":  # give up before the answer arrives
        try:
            r = await client.post(f"{url}{path}", timeout=0.05 + 0.2 * rng.random(), **kw)
        except httpx.TimeoutException:
            return 200, ""
        return r.status_code, "" if r.status_code == 200 else _error_shape(r)
    if isinstance(body, dict) and body.get("stream"):
        async with client.stream("POST", f"{url}{path}", **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, _error_shape(r)
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if line != "data: [DONE]" and "error" in json.loads(line[6:]):
                        return 500, f"error event: {line[:200]}"
                    if kind == "disconnect-mid-stream" and events >= rng.randint(1, 6):
                        return 200, ""  # leave: closing the stream disconnects
            return 200, "" if events else "empty stream"
    r = await client.post(f"{url}{path}", **kw)
    if r.status_code == 200:
        obj = r.json()
        return 200, "" if obj.get("choices") else f"no choices: {r.text[:200]}"
    return r.status_code, _error_shape(r)


def _error_shape(r) -> str:
    try:
        err = r.json()["error"]
        return "" if err.get("message") and err.get("type") else f"bad error body {r.text[:200]}"
    except Exception:
        return f"not an OpenAI error body: {r.text[:200]}"


async def _soak(url, kinds, num_requests, num_clients, seed):
    names = list(kinds)
    weights = [kinds[k][0] for k in names]
    counts = collections.Counter()
    statuses = collections.Counter()
    problems: list[str] = []
    rng_master = random.Random(seed)
    plan = [rng_master.choices(names, weights)[0] for _ in range(num_requests)]
    todo = asyncio.Queue()
    for i, k in enumerate(plan):
        todo.put_nowait((i, k))
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:

        async def worker():
            while True:
                try:
                    i, kind = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                rng = random.Random(seed * 100003 + i)
                path, body, expected = kinds[kind][1](rng)
                for attempt in range(MAX_RETRIES + 1):
                    try:
                        status, problem = await _send(client, url, kind, path, body, rng)
                    except httpx.HTTPError as e:
                        status, problem = None, f"transport error {type(e).__name__}: {e}"
                    if status != 429 or attempt == MAX_RETRIES:
                        break
                    # Back off like a real client (the openai client retries 429 too).
                    counts["retries after 429"] += 1
                    await asyncio.sleep(min(8.0, 0.25 * 2**attempt) * (0.5 + rng.random()))
                counts[kind] += 1
                statuses[(kind, status)] += 1
                if status not in expected or problem:
                    problems.append(f"{kind}: status {status}, expected {expected}; {problem}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(num_clients)))
        wall = time.perf_counter() - t0
    return counts, statuses, problems, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--policy", default="scheduled")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/serve-soak")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [it["messages"] for it in load_categories("chat,code,math", 10)]
    kinds = _kinds(prompts, a.max_model_len)
    args = ["--target", a.target, "--method", a.method, "--policy", a.policy, "--dtype", a.dtype]
    args += [
        "--max-batch",
        str(a.max_batch),
        "--max-queue",
        str(a.max_queue),
        "--max-model-len",
        str(a.max_model_len),
    ]
    args += ["--served-model-name", MODEL, "--log-level", "warning", "--shutdown-grace", "20"]
    with ServerProcess(args, _free_port(), LOG_DIR / "soak-server.log") as srv:
        counts, statuses, problems, wall = asyncio.run(_soak(srv.url, kinds, a.requests, a.clients, a.seed))
        # Let aborted requests drain, then check that nothing is left holding a slot.
        deadline, health = time.time() + 60, {}
        while time.time() < deadline:
            health = httpx.get(f"{srv.url}/health", timeout=10).json()
            if health.get("running") == 0 and health.get("waiting") == 0:
                break
            time.sleep(0.5)
        metrics = scrape(srv.url)
        alive = srv.alive()
    leaked = int(health.get("running", -1) != 0 or health.get("waiting", -1) != 0)
    free = metrics.get("specdecode_free_slots")
    served = sum(n for (k, s), n in statuses.items() if s == 200)
    results = {
        "settings": vars(a),
        "wall_s": wall,
        "requests": sum(n for k, n in counts.items() if k in kinds),
        "by_kind": {k: {str(s): n for (kk, s), n in statuses.items() if kk == k} for k in counts},
        "problems": problems,
        "server_alive_after": alive,
        "server_exit_code": srv.returncode,
        "health_after": health,
        "free_slots_after": free,
        "metrics_after": {k: v for k, v in metrics.items() if "_bucket" not in k},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# specdecode serve: soak run ({a.target}, {a.method}, policy {a.policy}, {a.dtype})",
        "",
        f"{results['requests']} requests from {a.clients} concurrent clients in {wall:.0f} s; server "
        f"--max-batch {a.max_batch} --max-queue {a.max_queue} --max-model-len {a.max_model_len}.",
        "",
        f"- answered 200: {served}; 429 after {MAX_RETRIES} retries with backoff (queue full): "
        f"{sum(n for (k, s), n in statuses.items() if s == 429)}; retries after a 429: "
        f"{counts['retries after 429']}",
        "- responses that broke their contract (wrong status, malformed body, 5xx, transport error): "
        f"{len(problems)}",
        f"- server alive after the run: {alive}; clean exit on SIGINT: {srv.returncode == 0} "
        f"(code {srv.returncode})",
        f"- leaked slots: {'none' if not leaked else 'YES'} (after the run: running {health.get('running')}, "
        f"queue {health.get('waiting')}, free slots {free} of {a.max_batch})",
        "- requests finished by outcome (server metrics): "
        + ", ".join(
            f"{k.split('outcome=')[1][1:-2]} {v:.0f}" for k, v in metrics.items() if "requests_total{" in k
        ),
        "",
        "| kind | requests | statuses |",
        "|---|---|---|",
    ]
    for k in sorted(k for k in counts if k in kinds):
        st = ", ".join(f"{s}: {n}" for (kk, s), n in sorted(statuses.items(), key=str) if kk == k)
        lines.append(f"| {k} | {counts[k]} | {st} |")
    if problems:
        lines += ["", "Problems:", *[f"- {p}" for p in problems[:50]]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print((out / "report.md").read_text())
    ok = alive and not leaked and not problems and srv.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
