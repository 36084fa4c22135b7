"""Target features for drafter training: computed by the frozen target, online or from a disk cache.

Contract:
- `TargetFeatures(target, layers)`: `__call__(batch)` runs the frozen target over
  `batch["input_ids"]` ([B, T], right-padded, `lengths` valid rows) and returns
  {layer: [B, T, d]} for the requested decoder layers (`-1` = final normed state), in the
  target's dtype, without gradients. Only the requested layers are kept.
- `FeatureCache(root, target, layers)`: optional. `build(seqs)` prints the size it will write,
  then stores each sequence's features (bf16 safetensors shards, written atomically, resumable:
  finished shards are kept); `__call__(batch)` reads them back for a batch (by `batch["index"]`).
  A cache made for another target or data is refused; one holding more layers serves a subset.
- `eval_batches(task, target, seqs, tokens_per_batch, max_batches)`: the first `max_batches`
  batches of `seqs` as training cuts them (`plan_batches`, seed 0, epoch 0), each yielded as
  (batch, features) on the task module's device, with the module in eval mode meanwhile (its
  mode is restored after): what offline evaluations feed `task.module`.
Legend: B batch, T rows, d width.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.training.data import collate, plan_batches

SHARD = 64  # sequences per cache shard


def eval_batches(task, target, seqs, tokens_per_batch: int, max_batches: int):
    """Yield (batch, features) for offline evaluation (see the module contract)."""
    features = TargetFeatures(target, task.feature_layers) if task.feature_layers else (lambda b: {})
    lengths = [len(s.input_ids) for s in seqs]
    dev = next(task.module.parameters()).device
    was_training = task.module.training
    task.module.eval()
    try:
        for idx in plan_batches(lengths, tokens_per_batch, seed=0, epoch=0)[:max_batches]:
            batch = collate([seqs[j] for j in idx])
            feats = {k: v.to(dev) for k, v in features(batch).items()}  # as the trainer moves them
            yield {k: v.to(dev) for k, v in batch.items()}, feats
    finally:
        task.module.train(was_training)


class TargetFeatures:
    def __init__(self, target, layers: tuple[int, ...]):
        self.target, self.layers = target, tuple(layers)

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict[int, torch.Tensor]:
        model = self.target.model
        ids, lengths = batch["input_ids"], batch["lengths"]
        B, T = ids.shape
        cache = model.new_cache(B, T)
        dev = model.info.device
        counts = lengths.tolist()
        out = model.forward(
            ids.to(dev),
            torch.arange(T, device=dev)[None].expand(B, T),
            cache,
            list(range(B)),
            num_new=counts if min(counts) != T else None,
            capture=self.layers,
            logits=False,
        )
        return {k: out.hidden[k] for k in self.layers}


class FeatureCache:
    def __init__(self, root: str | Path, target, layers: tuple[int, ...]):
        self.root, self.layers = Path(root), tuple(layers)
        self.source = TargetFeatures(target, layers)
        self.meta = {"target_fingerprint": target.fingerprint, "layers": list(self.layers)}
        self.d = target.model.info.hidden_size
        self._open: dict[int, dict] = {}

    def _shard(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.safetensors"

    def build(self, seqs: list, batch_tokens: int = 4096, progress: bool = True) -> None:
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            same = old.get("target_fingerprint") == self.meta["target_fingerprint"]
            same = same and old.get("num_sequences") == len(seqs) and set(self.layers) <= set(old["layers"])
            if not same:
                raise SpecDecodeError(
                    f"feature cache {self.root} was made for another target, layer set or data; "
                    "delete it or choose another --feature-cache"
                )
            if all(self._shard(i).exists() for i in range((len(seqs) + SHARD - 1) // SHARD)):
                return  # complete: a cache of more layers serves any subset of them
            self.layers = tuple(old["layers"])  # finish the interrupted build with its layer set
            self.source = TargetFeatures(self.source.target, self.layers)
        n_tok = sum(len(s.input_ids) for s in seqs)
        size = n_tok * len(self.layers) * self.d * 2
        print(
            f"feature cache {self.root}: {len(seqs)} sequences, {n_tok} tokens, "
            f"{len(self.layers)} layers -> {size / 2**20:.0f} MiB (bf16)"
        )
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(
            json.dumps({**self.meta, "layers": list(self.layers), "num_sequences": len(seqs)})
        )
        shards = range((len(seqs) + SHARD - 1) // SHARD)
        for sh in tqdm(shards, desc="target features", disable=not progress, dynamic_ncols=True):
            if self._shard(sh).exists():
                continue
            tensors = {}
            idx = list(range(sh * SHARD, min((sh + 1) * SHARD, len(seqs))))
            for start in range(0, len(idx), 8):
                part = idx[start : start + 8]
                batch = collate([seqs[i] for i in part])
                feats = self.source(batch)
                for b, i in enumerate(part):
                    n = int(batch["lengths"][b])
                    for layer, h in feats.items():
                        tensors[f"{i}/{layer}"] = h[b, :n].to(torch.bfloat16).cpu().contiguous()
            tmp = self._shard(sh).with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, self._shard(sh))

    def _get(self, i: int, layer: int) -> torch.Tensor:
        sh = i // SHARD
        if sh not in self._open:
            if not self._shard(sh).exists():
                raise SpecDecodeError(f"feature cache {self.root} lacks shard {sh}; run build() first")
            self._open[sh] = safe_open(str(self._shard(sh)), "pt")
        return self._open[sh].get_tensor(f"{i}/{layer}")

    def __call__(self, batch: dict) -> dict[int, torch.Tensor]:
        B, T = batch["input_ids"].shape
        out = {}
        for layer in self.layers:
            h = torch.zeros(B, T, self.d, dtype=torch.bfloat16)
            for b, i in enumerate(batch["index"].tolist()):
                x = self._get(i, layer)
                h[b, : x.shape[0]] = x
            out[layer] = h
        return out
