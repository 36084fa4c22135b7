"""z-lab DFlash checkpoints (`DFlashDraftModel` with a `dflash_config`): detection and import.

Contract:
- Layout: config.json is a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
  `block_size`, `num_target_layers` and `dflash_config` {`mask_token_id`, `target_layer_ids`};
  weights `fc.weight` (k d -> d), `hidden_norm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
  `layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.{input,post_attention}_layernorm`,
  `layers.{i}.mlp.*`, `norm.weight`. No embedding or LM head: both are the target's.
  `target_layer_ids` are 0-based decoder layers read as `hidden_states[id + 1]` (ours too);
  without them z-lab spreads `num_hidden_layers` ids from layer 1 to L - 3.
- `import_(path, cfg, state, target)` -> ("dflash", arch, state): the layer is ours with
  `qk_norm` and `mask_token_id` (dflash_family.from_foreign; full vocabulary, the target's head,
  slot 0 the anchor). Refused with the reason: a checkpoint for another target (layer count,
  width, vocabulary, feature layers), no mask token id, or a layer ours cannot compute.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.interop import dflash_family

ARCHITECTURE = "DFlashDraftModel"


def is_zlab(cfg: dict) -> bool:
    return ARCHITECTURE in (cfg.get("architectures") or []) and isinstance(cfg.get("dflash_config"), dict)


def layer_ids(cfg: dict) -> list[int]:
    ids = cfg["dflash_config"].get("target_layer_ids")
    if ids is not None:
        return [int(i) for i in ids]
    n, L = int(cfg["num_hidden_layers"]), int(cfg["num_target_layers"])
    if n == 1:
        return [L // 2]
    return [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]


def import_(path: Path, cfg: dict, state: dict[str, torch.Tensor], target) -> tuple[str, dict, dict]:
    where = f"z-lab DFlash drafter {path}"
    L = target.model.info.num_layers
    if int(cfg.get("num_target_layers", L)) != L:
        raise SpecDecodeError(
            f"{where} was built for a target with {cfg['num_target_layers']} layers; {target.name!r} "
            f"has {L}: use a drafter trained for this target"
        )
    info = {
        "layer_ids": layer_ids(cfg),
        "block_size": int(cfg.get("block_size", 16)),
        "mask_token_id": cfg["dflash_config"].get("mask_token_id"),
        "sample_from_anchor": False,  # z-lab: slot 0 is the anchor, slots 1.. draft
    }
    arch, ours = dflash_family.from_foreign(where, "dflash", cfg, state, info, target)
    return "dflash", arch, ours
