"""A compact, committable copy of regenerated data: token ids as uint16 (uint32 for larger
vocabularies) + offsets, compressed.

Contract:
- `pack_regen(regen_dir, out_file)` reads `specdecode data regen` output (every split present)
  and writes one `.npz` (numpy's compressed archive): per split `<split>.ids` (all tokens,
  concatenated), `<split>.offsets` [n + 1], `<split>.prompt_lens` [n] (the loss mask is 0 over
  the prompt and 1 over the response, so its length is enough), `<split>.finish` [n] (0 stop,
  1 length), `<split>.record_ids` (newline-joined), and `meta` (the regeneration's meta.json).
- `unpack_regen(file, out_dir)` writes the same records back as a regen directory that
  `read_regen` (and so training) reads; pack -> unpack -> read_regen gives identical records.
- A record whose loss mask is not prompt-zeros-then-response-ones is refused by `pack_regen`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from specdecode.errors import SpecDecodeError
from specdecode.training.regen import META, SPLITS

FINISH = ("stop", "length")


def pack_regen(regen_dir: str | Path, out_file: str | Path) -> dict:
    """Pack a regen directory into one compressed file; returns counts per split."""
    regen_dir, out_file = Path(regen_dir), Path(out_file)
    meta_path = regen_dir / META
    if not meta_path.is_file():
        raise SpecDecodeError(f"{regen_dir} holds no regenerated data ({META} missing)")
    arrays: dict[str, np.ndarray] = {"meta": np.array(meta_path.read_text())}
    counts = {}
    for split in SPLITS:
        path = regen_dir / f"{split}.jsonl"
        if not path.is_file():
            continue
        ids, offsets, prompt_lens, finish, names = [], [0], [], [], []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line of a run that was killed: regen redoes it too
                mask = rec["loss_mask"]
                p = mask.index(1) if 1 in mask else len(mask)
                if any(mask[:p]) or not all(mask[p:]):
                    raise SpecDecodeError(f"record {rec['id']!r}: loss mask is not prompt zeros then ones")
                ids.extend(rec["input_ids"])
                offsets.append(len(ids))
                prompt_lens.append(p)
                finish.append(FINISH.index(rec.get("finish_reason", "length")))
                names.append(rec["id"])
        dtype = np.uint16 if not ids or max(ids) < 2**16 else np.uint32
        arrays[f"{split}.ids"] = np.asarray(ids, dtype=dtype)
        arrays[f"{split}.offsets"] = np.asarray(offsets, dtype=np.int64)
        arrays[f"{split}.prompt_lens"] = np.asarray(prompt_lens, dtype=np.int32)
        arrays[f"{split}.finish"] = np.asarray(finish, dtype=np.uint8)
        arrays[f"{split}.record_ids"] = np.array("\n".join(names))
        counts[split] = {"records": len(names), "tokens": len(ids)}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, out_file)
    return counts


def unpack_regen(packed_file: str | Path, out_dir: str | Path) -> dict:
    """Write a packed file back as a regen directory; returns counts per split."""
    packed_file, out_dir = Path(packed_file), Path(out_dir)
    if not packed_file.is_file():
        raise SpecDecodeError(f"{packed_file} does not exist")
    data = np.load(packed_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        if f"{split}.ids" not in data:
            continue
        ids, offsets = data[f"{split}.ids"], data[f"{split}.offsets"]
        prompt_lens, finish = data[f"{split}.prompt_lens"], data[f"{split}.finish"]
        names = str(data[f"{split}.record_ids"]).split("\n") if len(prompt_lens) else []
        tmp = out_dir / f"{split}.jsonl.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            for i, name in enumerate(names):
                seq = ids[offsets[i] : offsets[i + 1]].tolist()
                p = int(prompt_lens[i])
                rec = {
                    "id": name,
                    "input_ids": seq,
                    "loss_mask": [0] * p + [1] * (len(seq) - p),
                    "finish_reason": FINISH[int(finish[i])],
                }
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, out_dir / f"{split}.jsonl")
        counts[split] = {"records": len(names), "tokens": int(len(ids))}
    (out_dir / META).write_text(str(data["meta"]))
    return counts
