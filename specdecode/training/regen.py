"""Regeneration: the target writes the responses its drafters are trained on (self-distillation).

Contract:
- `regenerate(target, data_dir, out_dir, ...)` reads the prompt set written by
  `specdecode data build` (`train.jsonl`, `heldout.jsonl`), applies the target's chat template
  (a model without one reads the user text as is),
  lets the target answer every prompt `samples` times through the decoding loop (plain `ar`,
  continuous batching: a finished answer's slot takes the next prompt at once; the runtime's
  measured weight formats; the samples of one prompt compute its rows once and copy them,
  `share_prefix`), and appends one record per answer to `out_dir/<split>.jsonl` as it
  finishes:
      {"id", "input_ids": prompt + response ids, "loss_mask": 0 over the prompt, 1 over the
       response (the EOS the target ended with included), "finish_reason"}
  The k-th sample of prompt `p` (k >= 1) has id `p#k`; each answer has its own seed.
  `temperature=None` is the target's usual one (its generation config, else 0.7).
- `out_dir/meta.json` records the target fingerprint, the sampling and the prompt set; a rerun
  with other settings into the same directory is refused (`overwrite=True` starts over).
- Resumable: records are flushed every few seconds; a rerun skips the ids already written (a
  torn last line from a kill is cut off first), so an interrupted run loses only the answers in
  flight. A prompt too long for `max_prompt_tokens` is skipped (counted in the summary).
- `read_regen(out_dir, split)` loads the records back and checks them against the meta.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

from tqdm import tqdm

from specdecode.chat import PromptItem, derive_seed, encode_prompt
from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ar import ARDrafter
from specdecode.errors import SpecDecodeError

SPLITS = ("train", "heldout")
META = "meta.json"
FLUSH_SECONDS = 5.0
DEFAULT_TEMPERATURE = 0.7


def prompt_ids(target, record: dict) -> list[int]:
    """A prompt-set record's token ids: the chat template when the target has one, else the
    user text as is (a base model)."""
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    if chat:
        item = PromptItem(id=record["id"], messages=record["messages"])
    else:
        item = PromptItem(id=record["id"], prompt=record["messages"][-1]["content"])
    return encode_prompt(target.tokenizer, item, chat=chat)


def read_prompts(data_dir: Path, split: str) -> list[dict]:
    path = data_dir / f"{split}.jsonl"
    if not path.is_file():
        raise SpecDecodeError(
            f"{path} does not exist; build a prompt set first: specdecode data build --out {data_dir}"
        )
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _done_ids(path: Path) -> set[str]:
    """Ids already regenerated; cuts off a torn last line left by a kill."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    return {json.loads(line)["id"] for line in data[:end].decode("utf-8").splitlines() if line.strip()}


def _check_meta(out_dir: Path, meta: dict, overwrite: bool) -> None:
    path = out_dir / META
    if path.exists() and not overwrite:
        old = json.loads(path.read_text())
        diff = [k for k in meta if old.get(k) != meta[k]]
        if diff:
            raise SpecDecodeError(
                f"{out_dir} holds a regeneration with other settings ({', '.join(diff)} differ); "
                "pass --overwrite to start over or choose another --out"
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        (out_dir / f"{split}.jsonl").unlink(missing_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)


def usual_temperature(target) -> float:
    """The temperature the target's generation config samples at, else 0.7."""
    cfg = target.path / "generation_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("temperature")
        if isinstance(t, (int, float)) and t > 0:
            return float(t)
    return DEFAULT_TEMPERATURE


def regenerate(
    target,  # LoadedModel
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    splits: tuple[str, ...] = SPLITS,
    max_new_tokens: int = 256,
    temperature: float | None = 0.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    samples: int = 1,
    limit: int | None = None,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    overwrite: bool = False,
    progress: bool = True,
    share_prefix: bool = True,
) -> dict:
    """Let the target answer the prompt set (see module docstring); returns a summary
    (answers, tokens, seconds, tokens/s, skipped prompts, prompt tokens copied between samples)."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if max_new_tokens < 1 or batch_size < 1 or samples < 1:
        raise SpecDecodeError("--max-new-tokens, --batch-size and --samples must be >= 1")
    if limit is not None and limit < 1:
        raise SpecDecodeError(f"--limit must be >= 1, got {limit}")
    bad = [s for s in splits if s not in SPLITS]
    if bad:
        raise SpecDecodeError(f"unknown split(s) {bad}; choose from {', '.join(SPLITS)}")
    if temperature is None:
        temperature = usual_temperature(target)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    stats = json.loads((data_dir / "stats.json").read_text()) if (data_dir / "stats.json").exists() else {}
    meta = {
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "prompt_set": stats.get("fingerprint", str(data_dir)),
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    if samples > 1:
        meta["samples"] = samples  # absent for one sample: older single-sample runs stay resumable
    _check_meta(out_dir, meta, overwrite)
    max_len = min(target.model.info.max_position, max_prompt_tokens + max_new_tokens)
    decoder = SpeculativeDecoder(target, ARDrafter(), max_batch=batch_size, share_prefix=share_prefix)
    decoder.reserve(batch_size, max_len + 2)
    eos = target.eos_token_ids[0] if target.eos_token_ids else None
    summary = {"answers": 0, "tokens": 0, "seconds": 0.0, "skipped_prompts": 0}
    for split in splits:
        records = read_prompts(data_dir, split)[:limit]
        path = out_dir / f"{split}.jsonl"
        done = _done_ids(path)
        jobs = [(r, k) for r in records for k in range(samples) if _sample_id(r["id"], k) not in done]
        total = len(records) * samples
        bar = tqdm(
            total=total, initial=total - len(jobs), desc=f"regen {split}", unit="answer",
            disable=not progress, dynamic_ncols=True,
        )  # fmt: skip
        prompts: dict[str, list[int]] = {}
        pending = iter(jobs)
        t0, n_tok, last_sync = time.perf_counter(), 0, time.perf_counter()

        def refill(pending=pending, prompts=prompts, bar=bar) -> None:
            # Keep a few requests waiting so a freed slot is taken in the same step.
            while decoder.num_waiting < batch_size:
                job = next(pending, None)
                if job is None:
                    return
                r, k = job
                ids = prompt_ids(target, r)
                if len(ids) > max_prompt_tokens:
                    summary["skipped_prompts"] += 1
                    bar.update(1)
                    continue
                sid = _sample_id(r["id"], k)
                prompts[sid] = ids
                decoder.add_request(
                    GenerationRequest(
                        prompt_ids=ids,
                        params=params,
                        max_new_tokens=max_new_tokens,
                        seed=derive_seed(seed, zlib.crc32(sid.encode())),
                        id=sid,
                        detokenize=False,  # only the ids are written
                    )
                )

        with path.open("a", encoding="utf-8") as f:
            refill()
            while decoder.has_unfinished():
                for ev in decoder.step():
                    res = ev.result
                    if res is None:
                        continue
                    resp = list(res.token_ids)
                    if res.finish_reason == "stop" and eos is not None:
                        resp.append(eos)  # the drafter must learn where the target stops
                    p = prompts.pop(res.id)
                    rec = {
                        "id": res.id,
                        "input_ids": p + resp,
                        "loss_mask": [0] * len(p) + [1] * len(resp),
                        "finish_reason": res.finish_reason,
                    }
                    f.write(json.dumps(rec) + "\n")
                    n_tok += len(resp)
                    summary["answers"] += 1
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}")
                refill()
                if time.perf_counter() - last_sync > FLUSH_SECONDS:
                    f.flush()
                    os.fsync(f.fileno())
                    last_sync = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        bar.close()
        summary["tokens"] += n_tok
        summary["seconds"] += time.perf_counter() - t0
    summary["tokens_per_s"] = summary["tokens"] / summary["seconds"] if summary["seconds"] else 0.0
    summary["shared_prompt_tokens"] = decoder.shared_tokens
    return summary


def _sample_id(prompt_id: str, k: int) -> str:
    return prompt_id if k == 0 else f"{prompt_id}#{k}"


def read_regen(
    out_dir: str | Path, split: str = "train", target_fingerprint: str | None = None
) -> list[dict]:
    """The regenerated records of one split; refuses data regenerated by another target."""
    out_dir = Path(out_dir)
    meta_path = out_dir / META
    if not meta_path.exists():
        raise SpecDecodeError(
            f"{out_dir} holds no regenerated data ({META} missing); run specdecode data regen first"
        )
    meta = json.loads(meta_path.read_text())
    if target_fingerprint is not None and meta["target_fingerprint"] != target_fingerprint:
        raise SpecDecodeError(
            f"{out_dir} was regenerated by {meta['target']!r}, not by this target; "
            "drafters must be trained on their own target's outputs: rerun specdecode data regen"
        )
    path = out_dir / f"{split}.jsonl"
    if not path.exists():
        raise SpecDecodeError(f"{path} does not exist; run specdecode data regen (split {split!r})")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
