"""The vLLM `speculators` layout: export our EAGLE-3, DFlash and DSpark drafters to it, import them.

Contract:
- A speculators directory holds `config.json` with `speculators_model_type` ("eagle3", "dflash",
  "dspark", ...), `architectures`, `transformer_layer_config` (a decoder-layer config),
  `draft_vocab_size`, `speculators_config` {`algorithm`, `proposal_methods` [{`proposal_type`:
  "greedy", `speculative_tokens`}], `default_proposal_method`, `verifier` {`name_or_path`,
  `architectures`}} and per-algorithm fields, plus `model.safetensors`. Feature-layer ids there
  index the target's hidden-state boundaries (0 = the embedding output), i.e. ours + 1.
- `export(cfg, state, out, verifier_name_or_path, target, num_speculative_tokens)` writes an
  EAGLE-3 drafter (eagle3.py names; `norm_before_residual: false`, `d2t` offsets + `t2d` mask
  for a reduced vocabulary; the embedding is not written unless `target` is given, since vLLM
  and speculators take it from the verifier), or a DFlash / DSpark drafter trained with
  `qk_norm` and `mask_token_id` (dflash_family.py: `dflash` / `dspark` model types, a Qwen3
  `transformer_layer_config`, the target's head rows for a reduced vocabulary, read from
  `target` or the verifier directory). Other DFlash-family checkpoints are refused naming the
  missing option. The verifier's `architectures` come from `target` or a local / installed
  config.json, else the export is refused (it would name no verifier). A `specdecode` block
  records where the weights came from (method, target name and fingerprint).
- `import_(path, cfg, state, target)` -> ("eagle" | "dflash" | "dspark", arch, state); refuses
  the variants our networks cannot compute (EAGLE-3: `norm_before_residual`, `norm_before_fc`,
  `fc_norm`, `norm_output`, another target width; DFlash family: dflash_family.from_foreign)
  and the other model types with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdecode.errors import SpecDecodeError
from specdecode.interop import dflash_family, eagle3
from specdecode.interop.common import verifier_facts, verifier_head

FORMAT_VERSION = "0.9.0"  # the speculators release whose config classes the tests validate against
DEFAULT_K = {"eagle": 4, "dflash": 7, "dspark": 7}


def _verifier(cfg: dict, name_or_path: str | None, target) -> dict:
    name = name_or_path or cfg["target"]["name"]
    facts = verifier_facts(name, target) or verifier_facts(cfg["target"]["name"])
    if facts is None:
        raise SpecDecodeError(
            f"cannot tell the verifier's architectures: {name!r} is neither a local model directory nor "
            "an installed alias; pass the target (--target) or a local verifier directory"
        )
    return {"name_or_path": name, "architectures": facts["architectures"], **facts}


def export(
    cfg: dict,  # our checkpoint's config.json
    state: dict[str, torch.Tensor],
    out: Path,
    verifier_name_or_path: str | None = None,
    target=None,  # LoadedModel, optional
    num_speculative_tokens: int | None = None,
) -> Path:
    method, arch = cfg["method"], cfg["arch"]
    if method in ("dflash", "dspark"):
        reasons = dflash_family.export_refusal(method, arch, state)
        if reasons:
            dflash_family.refuse(f"the {method} drafter", method, reasons)
    elif method != "eagle":
        raise SpecDecodeError(f"speculators has no layout for specdecode's {method!r} drafters")
    verifier = _verifier(cfg, verifier_name_or_path, target)
    dtype = str(state["fc.weight"].dtype).removeprefix("torch.")
    k = num_speculative_tokens or DEFAULT_K[method]
    if method != "eagle":
        return _export_dflash(cfg, state, out, verifier, target, verifier_name_or_path, k, dtype)
    tensors = eagle3.to_foreign(arch, state, prefix="layers.0.")
    if target is not None:
        w = target.model.embed(torch.arange(arch["target_vocab_size"], device=target.model.info.device))
        tensors["embed_tokens.weight"] = w.detach().to("cpu", state["fc.weight"].dtype).contiguous()
    config = {
        "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION,
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": eagle3.layer_config(arch, verifier["max_position_embeddings"], dtype),
        "draft_vocab_size": arch["draft_vocab_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in arch["feature_layers"]],
        "speculators_config": {
            "algorithm": "eagle3",
            **_proposal(k, verifier),
        },
        "torch_dtype": dtype,
        "specdecode": {"method": method, "target": cfg["target"]},
    }
    return _write(out, config, tensors)


def _proposal(k: int, verifier: dict) -> dict:
    return {
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": k,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {key: verifier[key] for key in ("name_or_path", "architectures")},
    }


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _export_dflash(cfg, state, out, verifier, target, verifier_name_or_path, k, dtype) -> Path:
    method, arch = cfg["method"], cfg["arch"]
    head = None
    if arch["draft_vocab_size"] < arch["target_vocab_size"]:  # only then is the head stored
        head = verifier_head(verifier_name_or_path or cfg["target"]["name"], target)
        if head is None:
            head = verifier_head(cfg["target"]["name"])
    tensors, fields = dflash_family.to_foreign(method, arch, state, head)
    num_drafts = arch["block_size"] - (0 if fields["sample_from_anchor"] else 1)
    config = {
        "speculators_model_type": method,
        "speculators_version": FORMAT_VERSION,
        "architectures": ["DFlashSpeculator" if method == "dflash" else "DSparkSpeculator"],
        "transformer_layer_config": dflash_family.layer_config(
            arch, verifier["max_position_embeddings"], dtype
        ),
        "draft_vocab_size": arch["draft_vocab_size"],
        **fields,
        "speculators_config": {"algorithm": method, **_proposal(min(k, num_drafts), verifier)},
        "torch_dtype": dtype,
        "specdecode": {"method": method, "target": cfg["target"]},
    }
    return _write(out, config, tensors)


def _our_layer_ids(ids: list[int] | None, target, where: str) -> list[int]:
    """speculators ids (hidden-state boundaries) -> our 0-based decoder-layer outputs."""
    L = target.model.info.num_layers
    if ids is None:  # speculators' default for EAGLE-3
        ids = [2, L // 2, L - 3]
    if any(i < 1 for i in ids):
        raise SpecDecodeError(f"{where} reads the embedding output (layer id 0); specdecode cannot")
    return [int(i) - 1 for i in ids]


def import_(path: Path, cfg: dict, state: dict[str, torch.Tensor], target) -> tuple[str, dict, dict]:
    kind = cfg.get("speculators_model_type")
    where = f"speculators {kind!r} drafter {path}"
    mine = cfg.get("specdecode", {}).get("target", {}).get("fingerprint")
    if mine and mine != target.fingerprint:
        raise SpecDecodeError(
            f"{where} was exported for target {cfg['specdecode']['target'].get('name')!r} "
            f"(fingerprint {mine}), not for {target.name!r}; use it with that target"
        )
    layer = cfg.get("transformer_layer_config") or {}
    if kind in ("dflash", "dspark"):
        th = cfg.get("target_hidden_size")
        if th is not None and th != layer.get("hidden_size"):
            d = layer.get("hidden_size")
            raise SpecDecodeError(f"{where} reads target features of width {th} into a {d}-wide layer")
        ids = cfg.get("aux_hidden_state_layer_ids")
        if ids is None:
            raise SpecDecodeError(
                f"{where} names no aux_hidden_state_layer_ids: which target layers it reads"
            )
        info = {**cfg, "layer_ids": _our_layer_ids(ids, target, where)}
        info.setdefault("sample_from_anchor", kind == "dspark")  # speculators' default per model type
        arch, ours = dflash_family.from_foreign(where, kind, layer, state, info, target)
        return kind, arch, ours
    if kind != "eagle3":
        raise SpecDecodeError(
            f"{where}: specdecode has no drafter of type {kind!r} (it imports eagle3, dflash and dspark)"
        )
    flags = [f for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if cfg.get(f)]
    if flags:
        raise SpecDecodeError(
            f"{where} sets {flags}; specdecode's EAGLE-3 keeps the raw feature as the residual and "
            "normalises nothing else, so it would compute another function"
        )
    th = cfg.get("target_hidden_size")
    if th is not None and th != layer.get("hidden_size"):
        d = layer.get("hidden_size")
        raise SpecDecodeError(f"{where} reads target features of width {th} into a {d}-wide layer")
    ids = _our_layer_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), target, where)
    arch, ours = eagle3.from_foreign(
        where, layer, state, "layers.0.", int(cfg.get("draft_vocab_size", layer["vocab_size"])), ids, target
    )
    return "eagle", arch, ours
