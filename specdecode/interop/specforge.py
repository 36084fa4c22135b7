"""SpecForge / SGLang EAGLE-3 checkpoints (`LlamaForCausalLMEagle3`): import, and export of ours.

Contract:
- Layout: config.json is a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`,
  `num_hidden_layers: 1`, `vocab_size` (the target's rows) and `draft_vocab_size`, optionally
  `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `fc.weight`, `midlayer.*` (one Llama
  layer with 2d-wide q/k/v and a `hidden_norm`), `norm.weight`, `lm_head.weight`, `d2t`
  (offsets) and `t2d` (bool mask), often also the frozen `embed_tokens.weight`.
- Feature layers: without ids SpecForge and SGLang use the outputs of decoder layers
  [1, L/2 - 1, L - 4] (0-based; ours too). Explicit ids are read as SGLang reads them: a list
  starting at 1 names layer outputs (our convention), any other list names layer inputs (our
  id + 1), since SGLang's fix of May 2026 (sgl-project/sglang#25454).
- `import_(path, cfg, state, target)` -> ("eagle", arch, state) via eagle3.from_foreign.
- `export(cfg, state, out)` writes that layout for one of our EAGLE-3 checkpoints; refused when
  the first feature layer is not 1 (SGLang versions disagree on such ids) and for other methods
  (DFlash / DSpark: no SpecForge layout; the message points to the speculators export).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdecode.errors import SpecDecodeError
from specdecode.interop import dflash_family, eagle3

ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_specforge(cfg: dict) -> bool:
    return ARCHITECTURE in (cfg.get("architectures") or []) and "speculators_model_type" not in cfg


def _our_layer_ids(cfg: dict, target, where: str) -> list[int]:
    L = target.model.info.num_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [1, L // 2 - 1, L - 4]
    ids = [int(i) for i in ids]
    return ids if ids and ids[0] == 1 else [i - 1 for i in ids]


def import_(path: Path, cfg: dict, state: dict[str, torch.Tensor], target) -> tuple[str, dict, dict]:
    where = f"SpecForge EAGLE-3 drafter {path}"
    if cfg.get("norm_before_residual") or cfg.get("norm_before_fc"):
        raise SpecDecodeError(
            f"{where} normalises the feature before the residual or the fc; specdecode's EAGLE-3 does not"
        )
    ids = _our_layer_ids(cfg, target, where)
    vd = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    arch, ours = eagle3.from_foreign(where, cfg, state, "midlayer.", vd, ids, target)
    return "eagle", arch, ours


def export(cfg: dict, state: dict[str, torch.Tensor], out: Path, max_position: int = 4096) -> Path:
    method, arch = cfg["method"], cfg["arch"]
    if method in ("dflash", "dspark"):
        why = "; ".join(dflash_family.export_refusal(method, arch, state))
        hint = f" (and for speculators: {why}; `specdecode train {method}` trains one that exports)"
        raise SpecDecodeError(
            f"SpecForge has no layout for specdecode's {method!r} drafters (only EAGLE-3); export "
            "--format speculators, which vLLM serves" + (hint if why else "")
        )
    if method != "eagle":
        raise SpecDecodeError(f"SpecForge has no layout for specdecode's {method!r} drafters (only EAGLE-3)")
    layers = list(arch["feature_layers"])
    if layers[0] != 1:
        raise SpecDecodeError(
            f"feature layers {layers} do not start at layer 1: SGLang releases read such ids with and "
            "without a +1 offset, so some would feed it the wrong features; use --format speculators"
        )
    dtype = str(state["fc.weight"].dtype).removeprefix("torch.")
    layer = eagle3.layer_config(arch, max_position, dtype)
    config = {
        **layer,
        "architectures": [ARCHITECTURE],
        "draft_vocab_size": arch["draft_vocab_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        "specdecode": {"method": method, "target": cfg["target"]},
    }
    tensors = eagle3.to_foreign(arch, state, prefix="midlayer.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
