"""Soak, fuzz and abuse run of `specdecode serve`: thousands of generated requests plus every abuse
kind, against a server child process on 127.0.0.1, with valid traffic timed before and during.

1. Quiet phase: `--valid-clients` clients send the same valid chat requests (greedy, fixed
   length) `--valid-requests` times; each request is timed end to end.
2. Abuse phase: the same valid traffic again, while `--abuse-clients` clients of a sender process
   (at nice `--abuse-nice`, 19: on this 2-core machine the sender's own CPU would otherwise be taken
   from the server, which an attacker elsewhere never does) drain a queue of
   - generated requests: `schemathesis` cases from the server's own /openapi.json (schema-valid
     and schema-violating, every operation) and `hypothesis` completion bodies with adversarial
     sampling values (`--generated` in all, >= 2,000 for the long form);
   - malformed requests (bad JSON, 100k-deep nesting, wrong types, unsupported parameters);
   - adversarial sampling values (temperature 1e-300, top_p 1e-46, NaN as a string, huge
     max_tokens and seeds);
   - oversized bodies (declared 9 MiB, chunked 16 MiB, a prompt over the context);
   - slow clients (a silent connection, a trickled request head, a trickled body);
   - disconnecting clients (mid-stream, and before a non-streamed answer).
   Generated requests are made shorter (max_tokens <= 8, also when a completion asks for the
   default 16; n <= 2; at most 2 prompts) so that the run measures abuse, not a heavier legitimate
   load; the report states the load each phase carried (requests and tokens the engine decoded).
3. After: the server must be alive and healthy, hold no request (running 0, queue 0, every slot
   free), have answered no 5xx (a 503 only for the connection limit or shutdown, a 429 for a full
   queue), and exit 0 on SIGINT. The report compares p50/p99 latency of the valid requests during
   abuse with the quiet phase (goal: p99 within 2x). Writes report.md and results.json.

    OMP_NUM_THREADS=2 python benchmarks/soak_serve.py     # SmolLM2-135M, ~4 min on the AMX kind

The defaults (4,800 generated requests, 120 valid requests a quiet phase) give each phase 120-160
timed requests, so that a p99 is not just the single slowest request of the phase.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import pickle
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdecode.bench.serve import ServerProcess, scrape
from specdecode.datasets import load_categories

MODEL = "soak"
LOG_DIR = Path(tempfile.gettempdir()) / "specdecode-serve-logs"  # server logs (not committed)
MIB = 1 << 20
DOCUMENTED_5XX = {503}  # the connection limit (uvicorn) and shutdown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- generated requests ---------------------------------------------------------------------
def _shorten(body, url: str = ""):
    """Keep generated traffic light (it should exercise the server, not outweigh the valid load):
    a valid max_tokens or n becomes small, an invalid one stays invalid; a list of prompts keeps
    two; chat gets max_tokens 8 when it asks for none (the rest of the context), a completion
    max_tokens 8 when it asks for none (the default 16)."""
    if not isinstance(body, dict):
        return body

    def valid_int(v, lo, hi):  # the server takes 16.0 for 16 too
        integral = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
        return integral and lo <= v <= hi

    for name in ("max_tokens", "max_completion_tokens"):
        if valid_int(body.get(name), 9, 1000):
            body[name] = 1 + int(body[name]) % 8
    if valid_int(body.get("n"), 3, 16):
        body["n"] = 1 + int(body["n"]) % 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 2 and not all(valid_int(t, 0, 2**31) for t in prompt):
        body["prompt"] = prompt[:2]  # a list of prompts (not one prompt of token ids)
    if url.endswith("chat/completions") and body.get("max_tokens") is None:
        if body.get("max_completion_tokens") is None:  # absent or null
            body["max_completion_tokens"] = 8
    if "prompt" in body and not url.endswith("chat/completions") and body.get("max_tokens") is None:
        body["max_tokens"] = 8
    return body


def generate(openapi: dict, num: int, seed: int) -> list[tuple[str, dict]]:
    """`num` requests: 2/3 schemathesis cases (both modes, all operations), 1/3 hypothesis bodies."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_dict(openapi)
    ops = [r.ok() for r in schema.get_all_operations()]
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    cases = st.one_of([op.as_strategy(generation_mode=m) for op in ops for m in modes])
    tiny = [1e-300, 5e-324, 1e-46, 1.4e-45, 1e-38, 9.99e-6, 1e-5]
    value = st.one_of(
        st.floats(0, 2),
        st.sampled_from(tiny + [-0.0, 2.0000001, 1e308, 10**30, "NaN", "Infinity", None, True, []]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(-(2**70), 2**70),
    )
    text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=60)
    fields = st.dictionaries(
        st.sampled_from(["temperature", "top_p", "top_k", "seed", "n", "max_tokens"]), value
    )
    bodies = st.builds(
        lambda p, f, stop, stream: {
            "model": MODEL,
            "prompt": p,
            "max_tokens": 6,
            **f,
            "stop": stop,
            "stream": stream,
        },
        st.one_of(text, st.just("Once upon a time")),
        fields,
        st.one_of(st.none(), text, st.lists(text, max_size=6)),
        st.booleans(),
    )
    out: list[tuple[str, dict]] = []
    config = settings(
        max_examples=1,
        deadline=None,
        database=None,
        derandomize=True,  # the same plan on every run: a problem request can be replayed
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )

    def collect(strategy, kind, n):
        @settings(config, max_examples=n)
        @given(x=strategy)
        def run(x):
            if kind == "hypothesis":
                out.append(
                    (
                        "generated: hypothesis sampling values",
                        {"method": "POST", "url": "/v1/completions", "body": _shorten(x)},
                    )
                )
                return
            mode = x.meta.generation.mode.value if x.meta else "positive"
            kw = x.as_transport_kwargs(base_url="")
            req = {
                "method": kw["method"],
                "url": kw["url"],
                "headers": {k: v for k, v in kw.get("headers", {}).items() if k.lower() in ("content-type",)},
            }
            if "json" in kw:  # schema-violating bodies are sent as generated
                req["body"] = _shorten(kw["json"], kw["url"]) if mode == "positive" else kw["json"]
            elif "data" in kw:
                req["raw"] = kw["data"] if isinstance(kw["data"], bytes) else str(kw["data"]).encode()
            out.append((f"generated: schemathesis {mode}", req))

        run()

    random.seed(seed)
    collect(cases, "schemathesis", (2 * num) // 3)
    collect(bodies, "hypothesis", num - (2 * num) // 3)
    return out


# ---- fixed abuse kinds ----------------------------------------------------------------------
def _post(url, body=None, raw=None, **extra) -> dict:
    return {"method": "POST", "url": url, "body": body, "raw": raw, **extra}


def _slow(head: str, trickle: bytes = b"") -> dict:
    return {"method": "SLOW", "head": head.encode(), "trickle": trickle}


def abuse_kinds(max_len: int) -> dict[str, list[tuple[str, dict]]]:
    """category -> [(name, request)] for the fixed abuse kinds; `_send` sends a request."""
    c, cc, soak = "/v1/completions", "/v1/chat/completions", b'{"model": "soak", "prompt": "hi", '
    ok = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6}
    long = {"max_tokens": min(200, max_len // 2), "ignore_eos": True}  # what a leaving client wanted
    deep = b"[" * 100_000 + b"]" * 100_000
    json_head = f"POST {c} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    story = [{"role": "user", "content": "Tell a story."}]
    return {
        "malformed": [
            ("bad JSON", _post(cc, raw=b'{"model": "soak", "messages": [')),
            ("100k-deep nesting", _post(c, raw=deep)),
            ("deep nesting in a field", _post(c, raw=soak + b'"stop": ' + deep[1:-1] + b"}")),
            ("not an object", _post(c, raw=b"[1, 2, 3]")),
            ("wrong type", _post(c, {**ok, "max_tokens": "ten"})),
            ("unsupported parameter", _post(c, {**ok, "frequency_penalty": 0.5})),
            ("unknown model", _post(c, {**ok, "model": "gpt-9"})),
            ("bad message", _post(cc, {"model": MODEL, "messages": [{"role": "x", "content": 1}]})),
            ("unpaired surrogate", _post(c, raw=b'{"model": "soak", "prompt": "\\ud800 hi"}')),
            ("unknown route", _post("/v1/engines", ok)),
        ],
        "adversarial sampling values": [
            ("temperature 1e-300", _post(c, {**ok, "temperature": 1e-300})),
            ("temperature 5e-324", _post(c, {**ok, "temperature": 5e-324})),
            ("top_p 1e-46", _post(c, {**ok, "top_p": 1e-46, "temperature": 1.0})),
            ("top_k 2**62", _post(c, {**ok, "top_k": 2**62, "temperature": 1.0})),
            ("temperature NaN as a string", _post(c, {**ok, "temperature": "NaN"})),
            ("top_p NaN literal", _post(c, raw=soak + b'"top_p": NaN}')),
            ("temperature 1e400 (inf)", _post(c, raw=soak + b'"temperature": 1e400}')),
            ("huge max_tokens", _post(c, {**ok, "max_tokens": 10**30})),
            ("5000-digit max_tokens", _post(c, raw=soak + b'"max_tokens": 1' + b"0" * 5000 + b"}")),
            ("seed 2**80", _post(c, {**ok, "seed": 2**80})),
            ("300-char stop", _post(c, {**ok, "stop": ["x" * 300]})),
            ("n 99", _post(c, {**ok, "n": 99})),
        ],
        "oversized": [
            (
                "declared 9 MiB",
                {**_slow(json_head + f"Content-Length: {9 * MIB}\r\n\r\n"), "method": "RAWHEAD"},
            ),
            ("chunked 16 MiB", {"method": "CHUNKED", "url": c, "mib": 16}),
            ("prompt over the context", _post(c, {"model": MODEL, "prompt": "word " * (4 * max_len)})),
            ("7 MiB prompt", _post(c, {"model": MODEL, "prompt": "a" * (7 * MIB)})),
        ],
        "slow": [
            ("silent connection", _slow("")),
            ("trickled head", _slow(f"POST {c} HTTP/1.1\r\n", b"Host: x\r\nX-Slow: " + b"a" * 200)),
            ("trickled body", _slow(json_head + "Content-Length: 200\r\n\r\n", soak + b"a" * 150)),
        ],
        "disconnecting": [
            (
                "mid-stream",
                _post(cc, {"model": MODEL, "messages": story, "stream": True, **long}, leave_after=2),
            ),
            ("before a non-streamed answer", _post(c, {**ok, **long, "n": 2}, leave_after_s=0.3)),
        ],
    }


async def _slow_client(port: int, head: bytes, trickle: bytes, gap_s: float = 0.25) -> int | None:
    """Send `head`, then one byte of `trickle` every gap_s until the server answers or closes;
    the status it answered (None: closed without an answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reply = asyncio.create_task(reader.read(64))
    try:
        writer.write(head)
        for b in trickle:
            if reply.done():
                break
            writer.write(bytes([b]))
            await writer.drain()
            await asyncio.sleep(gap_s)
        data = await asyncio.wait_for(reply, timeout=60)
        return int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
    except (ConnectionError, TimeoutError):
        return None
    finally:
        reply.cancel()
        writer.close()


async def _send(client: httpx.AsyncClient, port: int, req: dict) -> int | None:
    """Send one request; its status (None when the server closed the connection without one)."""
    method = req["method"]
    if method == "SLOW":
        return await _slow_client(port, req["head"], req["trickle"])
    if method == "RAWHEAD":
        return await _slow_client(port, req["head"], b"")
    if method == "CHUNKED":

        async def chunks():
            for _ in range(req["mib"]):
                yield b"x" * MIB

        try:
            r = await client.post(req["url"], content=chunks(), headers={"content-type": "application/json"})
            return r.status_code
        except httpx.TransportError:  # closed while we were still sending: refused
            return None
    headers = dict(req.get("headers") or {})
    if req.get("raw") is not None:
        kw = {"content": req["raw"], "headers": {"content-type": "application/json", **headers}}
    elif req.get("body") is not None:
        raw = json.dumps(req["body"]).encode()  # escapes unpaired surrogates as a client would
        kw = {"content": raw, "headers": {**headers, "content-type": "application/json"}}
    else:
        kw = {"headers": headers}
    if "leave_after" in req:
        async with client.stream(method, req["url"], **kw) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events >= req["leave_after"]:
                    break
            return r.status_code
    if "leave_after_s" in req:
        try:
            r = await client.request(method, req["url"], timeout=req["leave_after_s"], **kw)
            return r.status_code
        except httpx.TimeoutException:
            return 200  # left before the answer (the server aborts the request)
    r = await client.request(method, req["url"], **kw)
    if r.status_code >= 400 and r.status_code != 503:
        try:
            assert r.json()["error"]["message"]
        except Exception:
            return -r.status_code  # an error without an OpenAI error body
    return r.status_code


# ---- phases --------------------------------------------------------------------------------
async def _valid_traffic(url, prompts, clients, num, stop_when=None) -> list[float]:
    """`clients` loops of the same greedy chat requests; end-to-end latency of each (seconds).
    With `stop_when` they are sent until it is set (the abuse is over) instead of `num` times."""
    latencies: list[float] = []
    sent, statuses = 0, collections.Counter()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def worker(w):
            nonlocal sent
            while (sent < num) if stop_when is None else not stop_when.is_set():
                i = sent
                sent += 1
                body = {
                    "model": MODEL,
                    "messages": prompts[i % len(prompts)],
                    "max_tokens": 16,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=body)
                statuses[r.status_code] += 1
                latencies.append(time.perf_counter() - t0 if r.status_code == 200 else float("nan"))

        await asyncio.gather(*(worker(w) for w in range(clients)))
    if set(statuses) != {200}:
        print(f"valid requests answered {dict(statuses)}", file=sys.stderr)
    return latencies


problem_requests: list[dict] = []  # the requests behind `problems`, whole


async def _abuse(url, port, plan, clients):
    statuses: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    problems: list[str] = []
    problem_requests.clear()
    queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker():
            while not queue.empty():
                cat, name, req = queue.get_nowait()
                try:
                    status, problem = await _send(client, port, req), ""
                except httpx.HTTPError as e:
                    status, problem = None, f"{type(e).__name__} {e}"
                statuses[(cat, name)][status] += 1
                if status is not None and (status < 0 or (status >= 500 and status not in DOCUMENTED_5XX)):
                    problem = f"status {status}"
                if cat.endswith("schemathesis negative") and status == 200:
                    problem = "a schema-violating request was accepted"
                if problem:
                    problems.append(f"{cat} / {name}: {problem} for {str(req)[:300]}")
                    whole = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in req.items()}
                    problem_requests.append({"kind": cat, "name": name, "problem": problem, "request": whole})
                sent = sum(c.total() for c in statuses.values())
                if sent % 250 == 0:
                    print(f"{sent} of {len(plan)} sent", file=sys.stderr)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return statuses, problems


async def _abuse_in_child(url, port, plan, clients, nice: int):
    """Send the abuse plan from a child process at `nice` (the attacker's own CPU is not the
    server's: on this 2-core machine an unniced sender takes a core from the server); -> its
    statuses and problems."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "plan.pkl", Path(tmp) / "out.pkl"
        src.write_bytes(pickle.dumps(plan))
        cmd = [sys.executable, __file__, "--abuse-child", str(src), str(dst), url, str(port), str(clients)]
        proc = await asyncio.create_subprocess_exec(*cmd, preexec_fn=lambda: os.nice(nice))
        if await proc.wait() != 0:
            raise SystemExit(f"the abuse sender failed (exit {proc.returncode})")
        statuses, problems, requests = pickle.loads(dst.read_bytes())
    problem_requests[:] = requests
    return statuses, problems


def _abuse_child(src, dst, url, port, clients) -> int:
    plan = pickle.loads(Path(src).read_bytes())
    statuses, problems = asyncio.run(_abuse(url, int(port), plan, int(clients)))
    Path(dst).write_bytes(pickle.dumps((dict(statuses), problems, problem_requests)))
    return 0


def _machine() -> str:
    load = os.getloadavg()
    # pcpu is a lifetime average: a process paused during the run (state T) still shows one
    cmd = ["ps", "-eo", "pcpu,stat,args", "--sort=-pcpu"]
    top = subprocess.run(cmd, capture_output=True, text=True).stdout
    lines = [line.split(None, 2) for line in top.splitlines()[1:6] if float(line.split()[0]) > 5.0]
    busy = [
        re.sub(r"(?<!\S)/\S*/", "", f"{pcpu} {'(paused) ' if stat.startswith('T') else ''}{args}")[:100]
        for pcpu, stat, args in lines
    ]  # no machine paths in the report
    return f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; busiest (lifetime CPU %): " + (
        "; ".join(busy) or "none"
    )


LOAD = {  # what the engine decoded in a phase: server counters, differenced
    "requests": "specdecode_requests_total",
    "prompt_tokens": "specdecode_prompt_tokens_total",
    "generated_tokens": "specdecode_generation_tokens_total",
    "steps": "specdecode_steps_total",
    "verify_rows": "specdecode_verify_rows_total",
    "step_s": "specdecode_step_seconds_sum",  # engine time in decode / prefill steps
    "engine_steps": "specdecode_step_seconds_count",
}


def _load(before: dict, after: dict, wall_s: float) -> dict:
    def total(m, name):  # a counter summed over its labels
        return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))

    out = {k: total(after, n) - total(before, n) for k, n in LOAD.items()}
    out["wall_s"] = wall_s
    out["rows_per_step"] = out["verify_rows"] / out["steps"] if out["steps"] else 0.0
    out["generated_tok_per_s"] = out["generated_tokens"] / wall_s if wall_s else 0.0
    out["mean_step_ms"] = 1e3 * out["step_s"] / out["engine_steps"] if out["engine_steps"] else 0.0
    out["engine_busy"] = out["step_s"] / wall_s if wall_s else 0.0
    return out


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile of the finished requests."""
    xs = sorted(x for x in xs if x == x)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def main() -> int:
    if sys.argv[1:2] == ["--abuse-child"]:  # the sender process of _abuse_in_child
        return _abuse_child(*sys.argv[2:7])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--policy", default="scheduled")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--generated", type=int, default=4800, help="schemathesis + hypothesis requests")
    ap.add_argument("--repeat-abuse", type=int, default=5, help="times each fixed abuse kind is sent")
    ap.add_argument("--valid-clients", type=int, default=2)
    ap.add_argument("--valid-requests", type=int, default=120, help="per quiet phase")
    ap.add_argument("--abuse-clients", type=int, default=8)
    ap.add_argument(
        "--abuse-nice", type=int, default=19, help="niceness of the abuse sender process (0: the server's)"
    )
    ap.add_argument("--timeout-header", type=float, default=5.0)
    ap.add_argument("--timeout-body", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/soak-smollm2-135m")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [it["messages"] for it in load_categories("chat,code,math", 4)]
    args = ["--target", a.target, "--method", a.method, "--policy", a.policy, "--dtype", a.dtype]
    args += ["--max-batch", str(a.max_batch), "--max-queue", str(a.max_queue)]
    args += ["--max-model-len", str(a.max_model_len), "--served-model-name", MODEL, "--log-level", "warning"]
    args += ["--shutdown-grace", "20", "--timeout-header", str(a.timeout_header)]
    args += ["--timeout-body", str(a.timeout_body)]
    machine_before = _machine()
    port = _free_port()
    with ServerProcess(args, port, LOG_DIR / "soak-server.log") as srv:
        # 1. the requests: generated from the server's own schema, plus the fixed abuse kinds
        t0 = time.perf_counter()
        openapi = httpx.get(f"{srv.url}/openapi.json", timeout=30).json()
        generated = generate(openapi, a.generated, a.seed)
        gen_s = time.perf_counter() - t0
        plan = [(kind, "generated", req) for kind, req in generated]
        kinds = abuse_kinds(a.max_model_len)
        plan += [(cat, name, req) for cat in kinds for name, req in kinds[cat] for _ in range(a.repeat_abuse)]
        random.Random(a.seed).shuffle(plan)
        # 2. quiet phase (after a warm-up), then the same valid traffic during the abuse
        asyncio.run(_valid_traffic(srv.url, prompts, a.valid_clients, 2 * a.valid_clients))
        m0, t0 = scrape(srv.url), time.perf_counter()
        quiet = asyncio.run(_valid_traffic(srv.url, prompts, a.valid_clients, a.valid_requests))
        quiet_s = time.perf_counter() - t0
        m1 = scrape(srv.url)

        async def abuse_phase():
            done = asyncio.Event()
            valid = asyncio.create_task(
                _valid_traffic(srv.url, prompts, a.valid_clients, a.valid_requests, done)
            )
            statuses, problems = await _abuse_in_child(srv.url, port, plan, a.abuse_clients, a.abuse_nice)
            done.set()
            return await valid, statuses, problems

        t0 = time.perf_counter()
        during, statuses, problems = asyncio.run(abuse_phase())
        abuse_s = time.perf_counter() - t0
        m2 = scrape(srv.url)  # abuse requests still decoding finish in the drain below
        # 3. drain, then check that nothing holds a slot and the server still answers
        deadline, health = time.time() + 60, {}
        while time.time() < deadline:
            health = httpx.get(f"{srv.url}/health", timeout=10).json()
            if health.get("running") == 0 and health.get("waiting") == 0:
                break
            time.sleep(0.5)
        # the same valid traffic once more, quiet: shows how much the machine itself drifted
        m3, t0 = scrape(srv.url), time.perf_counter()
        after = asyncio.run(_valid_traffic(srv.url, prompts, a.valid_clients, a.valid_requests))
        after_s = time.perf_counter() - t0
        metrics = scrape(srv.url)
        alive = srv.alive()
    machine_after = _machine()
    free = metrics.get("specdecode_free_slots")
    leaked = health.get("running") != 0 or health.get("waiting") != 0 or free != a.max_batch
    by_cat: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (cat, _), st in statuses.items():
        by_cat[cat].update(st)
    fives = sum(n for st in statuses.values() for s, n in st.items() if s is not None and abs(s) >= 500)
    fives_undoc = sum(
        n for st in statuses.values() for s, n in st.items() if s and s >= 500 and s not in DOCUMENTED_5XX
    )
    fives_valid = sum(1 for x in during + quiet if x != x)
    q50, q99, d50, d99 = _pct(quiet, 0.5), _pct(quiet, 0.99), _pct(during, 0.5), _pct(during, 0.99)
    a50, a99 = _pct(after, 0.5), _pct(after, 0.99)
    load = {
        "quiet": _load(m0, m1, quiet_s),
        "abuse": _load(m1, m2, abuse_s),
        "quiet_after": _load(m3, metrics, after_s),
    }
    results = {
        "settings": vars(a),
        "load": load,
        "generation_s": gen_s,
        "quiet": {"wall_s": quiet_s, "latencies_s": quiet},
        "abuse": {"wall_s": abuse_s, "valid_latencies_s": during},
        "quiet_after": {"latencies_s": after},
        "by_kind": {f"{c} / {n}": {str(s): k for s, k in st.items()} for (c, n), st in statuses.items()},
        "problems": problems,
        "problem_requests": problem_requests,  # whole, for replaying (the plan is derandomized)
        "server_alive_after": alive,
        "server_exit_code": srv.returncode,
        "health_after": health,
        "valid_after_ok": all(x == x for x in quiet + during + after),
        "free_slots_after": free,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "metrics_after": {k: v for k, v in metrics.items() if "_bucket" not in k and "_created" not in k},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    sent = sum(sum(st.values()) for st in statuses.values())
    ratio = d99 / max(q99, a99)
    lines = [
        f"# specdecode serve: soak, fuzz and abuse ({a.target}, {a.method}, policy {a.policy}, {a.dtype})",
        "",
        f"Server: `--max-batch {a.max_batch} --max-queue {a.max_queue} --max-model-len {a.max_model_len} "
        f"--timeout-header {a.timeout_header:g} --timeout-body {a.timeout_body:g}` on 127.0.0.1, a child "
        f"process. Command: `OMP_NUM_THREADS=2 python benchmarks/soak_serve.py {' '.join(sys.argv[1:])}`.",
        "",
        f"- abuse phase: {sent} requests from {a.abuse_clients} clients of a sender process at nice "
        f"{a.abuse_nice} in {abuse_s:.0f} s "
        f"({len(generated)} generated in {gen_s:.0f} s by schemathesis from /openapi.json and by hypothesis, "
        f"plus {sent - len(generated)} fixed abuse requests), beside {len(during)} valid requests from "
        f"{a.valid_clients} clients",
        f"- abuse requests decoded by the engine (answered 200: generated or adversarial values that are "
        f"valid, disconnecting clients): {sum(st[200] for st in statuses.values())}",
        f"- 5xx answers: {fives} ({fives_undoc} undocumented; a 503 is documented only for the connection "
        f"limit or shutdown); valid requests that failed: {fives_valid}",
        f"- responses that broke their contract: {len(problems)}",
        f"- crashes: {'none' if alive and srv.returncode == 0 else 'YES'} (alive after the run: {alive}; "
        f"exit code on SIGINT: {srv.returncode}); every valid request answered: {results['valid_after_ok']}",
        f"- leaked slots: {'none' if not leaked else 'YES'} (running {health.get('running')}, queue "
        f"{health.get('waiting')}, free slots {free} of {a.max_batch})",
        f"- valid request latency (chat, 16 tokens, greedy), quiet before / during abuse / quiet after: "
        f"p50 {q50:.2f} / {d50:.2f} / {a50:.2f} s, p99 {q99:.2f} / {d99:.2f} / {a99:.2f} s (p99 during abuse "
        f"over the larger quiet p99: {ratio:.2f}; goal <= 2)",
        "- load each phase carried (what the engine decoded, from its counters; timed valid requests: "
        "16 tokens each), quiet before / during abuse / quiet after: "
        + "; ".join(
            f"{ph} {L['requests']:.0f} requests ({n} timed), {L['generated_tokens']:.0f} tokens generated "
            f"in {L['wall_s']:.0f} s ({L['generated_tok_per_s']:.1f} tok/s), {L['prompt_tokens']:.0f} prompt "
            f"tokens, {L['rows_per_step']:.1f} requests per decode step, engine steps "
            f"{L['mean_step_ms']:.0f} ms on average and busy {100 * L['engine_busy']:.0f} % of the time"
            for ph, L, n in [
                ("quiet before", load["quiet"], len(quiet)),
                ("during abuse", load["abuse"], len(during)),
                ("quiet after", load["quiet_after"], len(after)),
            ]
        ),
        "- requests finished by outcome (server metrics): "
        + ", ".join(
            f"{k.split('outcome=')[1][1:-2]} {v:.0f}" for k, v in metrics.items() if "requests_total{" in k
        ),
        f"- machine before: {machine_before}",
        f"- machine after: {machine_after}",
        "",
        "| category | requests | statuses (None: connection closed without an answer) |",
        "|---|---|---|",
    ]
    n_valid = len(quiet) + len(during) + len(after)
    lines.append(
        f"| valid (timed) | {n_valid} | quiet before {len(quiet)}, during abuse {len(during)}, quiet after "
        f"{len(after)}; all 200: {results['valid_after_ok']} |"
    )
    for cat in sorted(by_cat):
        st = ", ".join(f"{s}: {n}" for s, n in sorted(by_cat[cat].items(), key=str))
        lines.append(f"| {cat} | {sum(by_cat[cat].values())} | {st} |")
    lines += ["", "| fixed abuse kind | statuses |", "|---|---|"]
    for (cat, name), st in sorted(statuses.items()):
        if name != "generated":
            lines.append(
                f"| {cat} / {name} | {', '.join(f'{s}: {n}' for s, n in sorted(st.items(), key=str))} |"
            )
    if problems:
        lines += ["", "Problems:", *[f"- {p}" for p in problems[:50]]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print((out / "report.md").read_text())
    ok = alive and not leaked and not problems and srv.returncode == 0 and not fives_undoc
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
