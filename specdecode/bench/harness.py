"""`specdecode bench`: measure methods side by side on benchmark categories.

Contract:
- `BenchConfig` is validated at construction (unknown method / peer / dataset names list the
  valid ones, `limit` >= 1, temperatures >= 0, batch sizes >= 1, repeats >= 1).
- `run_bench(cfg)` writes `out/results.json` (one row per request and run: method, category,
  prompt id, T, batch, repeat, tau, per-position accepted/reached counts, emitted tokens,
  prefill / decode / draft / verify time, tokens/s, peak memory) after every batch of work,
  so an interrupted run resumes where it stopped (rows already present are skipped; a
  results file made with other settings is refused). Then `report.md` and PNG plots.
- Fairness: the baseline is our `ar` through the same loop; every method shares one loaded
  target; each (T, batch) configuration first runs a short warm-up per method (not recorded);
  methods run round-robin per prompt group so slow drifts hit all alike; prefill is excluded
  from decode time and reported separately; the same token ids are given to every method.
- Peers (`hf`, `hf-assisted`, `hf-lookup`: transformers `generate` plain / with the same draft
  model / prompt lookup) run in the same process at batch 1, for the ratio on a noisy machine.
- The hardware limit: the machine's read bandwidth is measured at the start (the batch-1
  ceiling bandwidth / weight bytes is reported beside our `ar`) and again at the end of the run.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdecode.bench import hardware
from specdecode.bench.report import write_report
from specdecode.build import LoadOptions, build
from specdecode.chat import derive_seed
from specdecode.config import SamplingParams
from specdecode.datasets import load_categories, load_jsonl_prompts
from specdecode.decode import GenerationRequest
from specdecode.drafters import METHODS
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model

PEERS = ("hf", "hf-assisted", "hf-lookup")


@dataclass
class BenchConfig:
    target: str = "smollm2-135m"
    methods: list[str] = field(default_factory=lambda: ["ar", "ngram"])
    drafters: dict[str, str] = field(default_factory=dict)  # method -> drafter model
    datasets: str = "all"  # category names, "all", or a FILE.jsonl
    limit: int | None = 8
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    max_new_tokens: int = 128
    repeats: int = 1
    peers: list[str] = field(default_factory=list)
    num_draft_tokens: int | None = None
    policy: str = "adaptive"
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    out: str = "bench-out"

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise SpecDecodeError(f"unknown method(s) {bad}; choose from: {', '.join(METHODS)}")
        if "ar" not in self.methods:
            self.methods = ["ar", *self.methods]  # the baseline every speed-up is measured against
        bad = [p for p in self.peers if p not in PEERS]
        if bad:
            raise SpecDecodeError(f"unknown peer(s) {bad}; choose from: {', '.join(PEERS)}")
        for m in self.drafters:
            if m not in self.methods:
                raise SpecDecodeError(f"--drafter given for {m!r}, which is not among --methods")
        if self.limit is not None and self.limit < 1:
            raise SpecDecodeError(f"--limit must be >= 1, got {self.limit}")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise SpecDecodeError("--temperature values must be >= 0")
        if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
            raise SpecDecodeError("--batch-size values must be >= 1")
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise SpecDecodeError("--repeats and --max-new-tokens must be >= 1")
        if "hf-assisted" in self.peers and "draft" not in self.drafters:
            raise SpecDecodeError("the hf-assisted peer needs the draft model: pass --drafter draft=MODEL")

    def load_options(self, target, method: str) -> LoadOptions:
        """How `method` is built over the shared, already loaded `target`."""
        return LoadOptions(
            target,
            method,
            self.drafters.get(method),
            num_draft_tokens=self.num_draft_tokens,
            policy=self.policy,
            dtype=self.dtype,
            device=self.device,
            max_batch=max(self.batch_sizes),
        )

    def settings(self) -> dict:
        """What must match for a results file to be resumed."""
        d = asdict(self)
        d.pop("out")
        return d


def load_items(datasets: str, limit: int | None) -> list[dict]:
    if datasets.endswith(".jsonl"):
        return load_jsonl_prompts(datasets, limit=limit)
    return load_categories(datasets, limit=limit)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, dtype: torch.dtype, device: str):
    """One transformers model per (path, dtype, device), shared by the peers of a process (the
    plain, assisted and lookup peers run the same target: one copy, not three)."""
    from transformers import AutoModelForCausalLM  # deferred: heavy, only the peers use it

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


class TransformersPeer:
    """transformers `generate` (plain, assisted with a draft model, or prompt lookup), batch 1,
    same dtype and process as our runs. Decode time excludes prefill: the time to the first
    token is measured by a separate 1-token generate and subtracted."""

    def __init__(
        self, kind: str, target_path, drafter_path, dtype: torch.dtype, device: torch.device | str = "cpu"
    ):
        if kind not in PEERS:
            raise SpecDecodeError(f"unknown peer {kind!r}; choose from: {', '.join(PEERS)}")
        self.kind = kind
        self.model = _hf_model(str(target_path), dtype, str(device))
        self.assistant = _hf_model(str(drafter_path), dtype, str(device)) if kind == "hf-assisted" else None

    @torch.inference_mode()
    def run(self, ids: list[int], max_new: int, temperature: float = 0.0, seed: int = 0) -> dict:
        x = torch.tensor([ids], device=self.model.device)
        kw = dict(max_new_tokens=max_new, do_sample=temperature > 0, attention_mask=torch.ones_like(x))
        if temperature > 0:
            kw.update(temperature=temperature, top_k=0, top_p=1.0)
        if self.kind == "hf-assisted":
            kw["assistant_model"] = self.assistant
        if self.kind == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = 10
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        self.model.generate(x, **{**kw, "max_new_tokens": 1})  # time to first token, subtracted
        t_first = time.perf_counter() - t0
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = self.model.generate(x, **kw)
        total = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        n = len(new)
        decode = max(total - t_first, 1e-9) * n / max(n - 1, 1)
        return {
            "token_ids": new,
            "num_new_tokens": n,
            "decode_time_s": decode,
            "prefill_time_s": t_first,
            "tokens_per_s": n / decode,
        }


def _run_key(row: dict) -> tuple:
    return (row["method"], row["prompt_id"], row["temperature"], row["batch"], row["repeat"])


def _save(path: Path, cfg: BenchConfig, meta: dict, rows: list[dict]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"settings": cfg.settings(), "meta": meta, "runs": rows}, indent=1))
    os.replace(tmp, path)


def run_bench(cfg: BenchConfig, progress: bool = True) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    items = load_items(cfg.datasets, cfg.limit)
    rows: list[dict] = []
    meta: dict = {}
    if results.exists():
        old = json.loads(results.read_text())
        if old.get("settings") != cfg.settings():
            raise SpecDecodeError(
                f"{results} was written with other settings; pass another --out or delete it to start over"
            )
        rows, meta = old["runs"], old.get("meta", {})
    done = {_run_key(r) for r in rows}

    target = load_model(cfg.target, dtype=cfg.dtype, device=cfg.device)
    dev = target.model.info.device
    if "bandwidth_GBps" not in meta:
        bw = hardware.measure_read_bandwidth(device=dev)
        meta.update(hardware.machine_info())
        meta.update(
            bandwidth_GBps=bw / 1e9,
            weight_MB=hardware.weight_bytes(target.model) / 1e6,
            ar_ceiling_tokens_per_s=hardware.ar_ceiling(target.model, bw),
            target=cfg.target,
            dtype=cfg.dtype,
        )
    sds = {m: build(cfg.load_options(target, m)) for m in cfg.methods}
    peers = {}
    if cfg.peers:
        drafter_path = (
            load_model(cfg.drafters["draft"], dtype=cfg.dtype).path if "draft" in cfg.drafters else None
        )
        peers = {
            p: TransformersPeer(p, target.path, drafter_path, target.model.info.dtype, dev) for p in cfg.peers
        }
    tok = target.tokenizer
    encoded = [
        (it, tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=True)["input_ids"])
        for it in items
    ]

    todo = []  # (T, B, repeat, group of (item, ids))
    for t in cfg.temperatures:
        for b in cfg.batch_sizes:
            for rep in range(cfg.repeats):
                for g in range(0, len(encoded), b):
                    todo.append((t, b, rep, encoded[g : g + b]))
    total = len(todo) * (len(sds) + len(peers))
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    warmed = set()
    for t, b, rep, group in todo:
        params = SamplingParams(temperature=t)
        if (t, b) not in warmed:  # warm-up per configuration, not recorded
            for sd in sds.values():
                sd.decoder.generate([GenerationRequest(group[0][1], params, 8, id="warm")])
            warmed.add((t, b))
        for m, sd in sds.items():
            keys = [(m, it["id"], t, b, rep) for it, _ in group]
            bar.update(1)  # counted when taken up, so a resumed run shows its true progress
            if all(k in done for k in keys):
                continue
            bar.set_postfix_str(f"{m} T={t} B={b} {group[0][0]['id']}")
            reqs = [
                GenerationRequest(
                    ids, params, cfg.max_new_tokens, seed=derive_seed(cfg.seed + rep, j), id=it["id"]
                )
                for j, (it, ids) in enumerate(group)
            ]
            d0, v0 = sd.decoder.draft_time, sd.decoder.verify_time
            t0 = time.perf_counter()
            res = sd.decoder.generate(reqs)
            wall = time.perf_counter() - t0
            d_t, v_t = sd.decoder.draft_time - d0, sd.decoder.verify_time - v0
            for (it, _), r in zip(group, res, strict=True):
                rows.append(
                    {
                        "method": m,
                        "category": it["category"],
                        "prompt_id": it["id"],
                        "temperature": t,
                        "batch": b,
                        "repeat": rep,
                        "tau": r.tau,
                        "num_steps": r.num_steps,
                        "accepted_per_position": r.accepted_per_position,
                        "reached_per_position": r.reached_per_position,
                        "num_drafted": r.num_drafted,
                        "num_new_tokens": r.num_new_tokens,
                        "prefill_time_s": r.prefill_time_s,
                        "decode_time_s": r.decode_time_s,
                        "draft_time_s": d_t / len(res),
                        "verify_time_s": v_t / len(res),
                        "batch_wall_s": wall,
                        "tokens_per_s": r.tokens_per_s,
                        "peak_rss_MB": _peak_rss_mb(),
                    }
                )
            done.update(keys)
        for p, peer in peers.items():
            bar.update(1)
            if b != 1:
                continue  # peers are measured at batch 1 only
            it, ids = group[0]
            if (p, it["id"], t, b, rep) in done:
                continue
            r = peer.run(ids, cfg.max_new_tokens, t, derive_seed(cfg.seed + rep, 0))
            r.pop("token_ids")
            rows.append(
                {
                    "method": p,
                    "category": it["category"],
                    "prompt_id": it["id"],
                    "temperature": t,
                    "batch": b,
                    "repeat": rep,
                    "tau": None,
                    **r,
                    "peak_rss_MB": _peak_rss_mb(),
                }
            )
            done.add((p, it["id"], t, b, rep))
        _save(results, cfg, meta, rows)
    bar.close()
    # Read again at the end: a host whose speed drifts over a long run shows it in the report
    meta["bandwidth_end_GBps"] = hardware.measure_read_bandwidth(device=dev) / 1e9
    _save(results, cfg, meta, rows)
    write_report(out, cfg, meta, rows)
    return out
