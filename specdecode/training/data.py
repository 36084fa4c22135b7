"""Training batches over regenerated sequences.

Contract:
- `load_sequences(regen_dir, split, max_len, target_fingerprint)` -> list of `Sequence` (ids and
  loss mask as long tensors, cut to `max_len`; sequences without a response token dropped).
  `regen_dir` may name several directories (`regen_dirs`: comma-separated or a list), each
  checked against the target; their sequences are read in the order given.
- `plan_batches(lengths, tokens_per_batch, seed, epoch)` -> list of index lists: sequences of
  similar length grouped so that padded rows x max length <= tokens_per_batch, in an order fixed
  by (seed, epoch). The trainer walks it with a global cursor, so a resumed run sees exactly the
  batches the killed run would have seen; DDP rank r takes every world-th batch.
- `collate(seqs)` -> dict(input_ids [B, T], loss_mask [B, T], lengths [B]) right-padded with 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specdecode.errors import SpecDecodeError
from specdecode.training.regen import read_regen


@dataclass
class Sequence:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] long (1 = response token)


def regen_dirs(regen_dir) -> list[str]:
    """`"a,b"`, a path or a list of them -> the directories, in order."""
    parts = [regen_dir] if not isinstance(regen_dir, (list, tuple)) else list(regen_dir)
    dirs = [d.strip() for p in parts for d in str(p).split(",") if d.strip()]
    if not dirs:
        raise SpecDecodeError("no regenerated data directory given (--data DIR[,DIR...])")
    return dirs


def load_sequences(
    regen_dir, split: str, max_len: int, target_fingerprint: str | None = None
) -> list[Sequence]:
    out = []
    for d in regen_dirs(regen_dir):
        for rec in read_regen(d, split, target_fingerprint):
            ids, mask = rec["input_ids"][:max_len], rec["loss_mask"][:max_len]
            if sum(mask) >= 2:
                out.append(Sequence(torch.tensor(ids), torch.tensor(mask)))
    if not out:
        raise SpecDecodeError(f"{regen_dir} ({split}) has no sequence with a response to train on")
    return out


def plan_batches(lengths: list[int], tokens_per_batch: int, seed: int, epoch: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + epoch)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    T = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s.input_ids)] = s.input_ids
        mask[b, : len(s.loss_mask)] = s.loss_mask
    return {"input_ids": ids, "loss_mask": mask, "lengths": torch.tensor([len(s.input_ids) for s in seqs])}
