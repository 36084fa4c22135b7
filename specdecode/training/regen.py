"""Regeneration: the target writes the responses its drafters are trained on (self-distillation).

Contract:
- `regenerate(target, data_dir, out_dir, ...)` reads the prompt set written by
  `specdecode data build` (`train.jsonl`, `heldout.jsonl`), applies the target's chat template
  (a model without one reads the user text as is),
  lets the target answer every prompt through the decoding loop (plain `ar`, batched, the
  sampling given), and appends one record per prompt to `out_dir/<split>.jsonl`:
      {"id", "input_ids": prompt + response ids, "loss_mask": 0 over the prompt, 1 over the
       response (the EOS the target ended with included), "finish_reason"}
- `out_dir/meta.json` records the target fingerprint, the sampling and the prompt set; a rerun
  with other settings into the same directory is refused (`overwrite=True` starts over).
- Resumable: records are flushed after every batch; a rerun skips the ids already written (a
  torn last line from a kill is cut off first), so an interrupted run loses at most one batch.
- `read_regen(out_dir, split)` loads the records back and checks them against the meta.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.prompts import PromptItem, derive_seed, encode_prompt

SPLITS = ("train", "heldout")
META = "meta.json"


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


def regenerate(
    target,  # LoadedModel
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    splits: tuple[str, ...] = SPLITS,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    limit: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Let the target answer the prompt set (see module docstring); returns `out_dir`."""
    from tqdm import tqdm

    from specdecode.decode import GenerationRequest, SpeculativeDecoder
    from specdecode.drafters.ar import ARDrafter

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if max_new_tokens < 1 or batch_size < 1:
        raise SpecDecodeError("--max-new-tokens and --batch-size must be >= 1")
    if limit is not None and limit < 1:
        raise SpecDecodeError(f"--limit must be >= 1, got {limit}")
    bad = [s for s in splits if s not in SPLITS]
    if bad:
        raise SpecDecodeError(f"unknown split(s) {bad}; choose from {', '.join(SPLITS)}")
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
    _check_meta(out_dir, meta, overwrite)
    decoder = SpeculativeDecoder(target, ARDrafter(), max_batch=batch_size)
    eos = target.eos_token_ids[0] if target.eos_token_ids else None
    for split in splits:
        records = read_prompts(data_dir, split)[:limit]
        path = out_dir / f"{split}.jsonl"
        done = _done_ids(path)
        todo = [r for r in records if r["id"] not in done]
        bar = tqdm(
            total=len(records),
            initial=len(records) - len(todo),
            desc=f"regen {split}",
            unit="prompt",
            disable=not progress,
            dynamic_ncols=True,
        )
        t0, n_tok = time.perf_counter(), 0
        with path.open("a", encoding="utf-8") as f:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                reqs, prompts = [], {}
                for r in chunk:
                    ids = prompt_ids(target, r)
                    prompts[r["id"]] = ids
                    reqs.append(
                        GenerationRequest(
                            prompt_ids=ids,
                            params=params,
                            max_new_tokens=max_new_tokens,
                            seed=derive_seed(seed, zlib.crc32(r["id"].encode())),
                            id=r["id"],
                        )
                    )
                for res in decoder.generate(reqs):
                    resp = list(res.token_ids)
                    if res.finish_reason == "stop" and eos is not None:
                        resp.append(eos)  # the drafter must learn where the target stops
                    p = prompts[res.id]
                    rec = {
                        "id": res.id,
                        "input_ids": p + resp,
                        "loss_mask": [0] * len(p) + [1] * len(resp),
                        "finish_reason": res.finish_reason,
                    }
                    f.write(json.dumps(rec) + "\n")
                    n_tok += len(resp)
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}")
        bar.close()
    return out_dir


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
