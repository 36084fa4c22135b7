"""Shared pieces of the interop converters: files, vocabulary maps and target checks.

Contract:
- `read_json(path)` / `read_weights(dir)`: a foreign directory's `config.json` and its weights
  (`model.safetensors`, or every `*.safetensors` shard), refused with the reason when missing.
- Vocabulary maps. Ours: `d2t[i]` = the target id of draft id i (any order). The EAGLE-3 /
  speculators convention: draft ids are in increasing target-id order, `d2t[i]` is an OFFSET
  (target id = i + d2t[i]) and `t2d` is a bool mask [V] of the target ids in the draft
  vocabulary. `sorted_vocab(d2t)` gives the permutation that puts our draft ids in target-id
  order (rows of every draft-vocabulary tensor are permuted with it, which changes no logit);
  `offsets_from_ids` / `ids_from_offsets` convert between the two `d2t` forms; `t2d_mask`
  builds the mask; `check_vocab_maps` refuses inconsistent foreign maps.
- `check_target(where, target, hidden_size, vocab_size, num_layers, layer_ids)`: refuses a
  foreign drafter built for another target (width, vocabulary rows, a feature layer the target
  does not have) with what differs.
- `check_embedding(where, state, target)`: a stored `embed_tokens.weight` must be the target's
  (to 1e-2): our drafters read the target's embedding. `rope_theta(layer, where)`: the RoPE base
  of a foreign layer config, refusing RoPE scaling (our drafter layers use plain RoPE).
- `verifier_facts(name_or_path, target)` -> {"architectures", "max_position_embeddings"} of the
  verifier, from a loaded target's config or a local / installed model directory's config.json;
  None when neither is at hand (nothing is downloaded). `verifier_head(name_or_path, target)` ->
  its output head [V, d] (the embedding when tied) from the same places, or None.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdecode.assets import MODELS, is_installed, model_dir
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import open_checkpoint


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise SpecDecodeError(f"{path.parent} has no {path.name}: not a drafter checkpoint directory")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecDecodeError(f"{path} is not valid JSON ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise SpecDecodeError(f"{path} does not hold a JSON object")
    return cfg


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecDecodeError(
            f"{directory} has no *.safetensors weights (only safetensors checkpoints are read; "
            "convert a pytorch_model.bin with `safetensors.torch.save_file` first)"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


# ---- vocabulary maps ------------------------------------------------------------------------
def sorted_vocab(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] our draft->target ids -> [Vd] permutation `perm` with d2t[perm] increasing."""
    ids = d2t.long().cpu()
    if len(torch.unique(ids)) != len(ids):
        raise SpecDecodeError("the drafter's d2t maps two draft ids to one target id: a broken checkpoint")
    return torch.argsort(ids)


def offsets_from_ids(sorted_ids: torch.Tensor) -> torch.Tensor:
    """[Vd] increasing target ids -> [Vd] int64 offsets (target id = draft id + offset)."""
    return sorted_ids.long() - torch.arange(len(sorted_ids))


def ids_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    return offsets.long() + torch.arange(len(offsets))


def t2d_mask(sorted_ids: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    mask = torch.zeros(vocab_rows, dtype=torch.bool)
    mask[sorted_ids.long()] = True
    return mask


def check_vocab_maps(where: str, ids: torch.Tensor, t2d: torch.Tensor | None, vocab_rows: int) -> None:
    """Foreign d2t (as target ids) must be in range, distinct, and agree with the t2d mask."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_rows):
        raise SpecDecodeError(f"{where}: d2t points outside the target vocabulary (0..{vocab_rows - 1})")
    if len(torch.unique(ids)) != len(ids):
        raise SpecDecodeError(f"{where}: d2t maps two draft ids to one target id")
    if t2d is not None:
        if t2d.shape != (vocab_rows,):
            raise SpecDecodeError(f"{where}: t2d has shape {tuple(t2d.shape)}; the target has {vocab_rows}")
        if not torch.equal(t2d.bool(), t2d_mask(ids, vocab_rows)):
            raise SpecDecodeError(f"{where}: t2d and d2t disagree (t2d must mark the ids d2t reaches)")


# ---- targets --------------------------------------------------------------------------------
def check_target(
    where: str,
    target,  # LoadedModel
    hidden_size: int,
    vocab_size: int,
    layer_ids: list[int] | tuple[int, ...],
) -> None:
    info = target.model.info
    problems = []
    if hidden_size != info.hidden_size:
        problems.append(f"hidden size {hidden_size} (the target's is {info.hidden_size})")
    if vocab_size != info.vocab_size:
        problems.append(f"vocabulary of {vocab_size} rows (the target has {info.vocab_size})")
    bad = [i for i in layer_ids if not 0 <= i < info.num_layers]
    if bad:
        problems.append(f"feature layers {bad} (the target has {info.num_layers} decoder layers)")
    if problems:
        raise SpecDecodeError(
            f"{where} was built for another target: " + "; ".join(problems) + f". It cannot draft for "
            f"{target.name!r}: use a drafter trained for this target (or train one with `specdecode train`)"
        )


def check_embedding(where: str, state: dict[str, torch.Tensor], target) -> None:
    """A stored embedding is accepted only if it is the target's (ours reads the target's)."""
    emb = state.get("embed_tokens.weight")
    if emb is None:
        return
    theirs = target.model.embed(torch.arange(emb.shape[0], device=target.model.info.device)).float().cpu()
    if emb.shape != theirs.shape or not torch.allclose(emb.float(), theirs, rtol=1e-2, atol=1e-2):
        raise SpecDecodeError(
            f"{where} stores its own token embedding, which differs from the target's; specdecode's "
            "drafter reads the target's embedding, so it would draft differently"
        )


def rope_theta(layer: dict, where: str) -> float:
    params = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise SpecDecodeError(f"{where}: RoPE type {kind!r}; specdecode's drafter layers use plain RoPE")
    return float(params.get("rope_theta") or layer.get("rope_theta") or 10000.0)


def _verifier_dir(name_or_path: str | None) -> Path | None:
    """A local or installed model directory holding the verifier's config.json, or None."""
    if not name_or_path:
        return None
    candidates = [Path(name_or_path).expanduser()]
    try:
        if name_or_path in MODELS and is_installed(name_or_path):
            candidates.append(Path(model_dir(name_or_path)))
    except ImportError:
        pass
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def verifier_facts(name_or_path: str | None, target=None) -> dict | None:
    cfg = None
    if target is not None and getattr(target, "config", None) is not None:
        cfg = target.config.to_dict()
    elif (d := _verifier_dir(name_or_path)) is not None:
        cfg = json.loads((d / "config.json").read_text())
    if cfg is None:
        return None
    text = cfg.get("text_config") or cfg  # multimodal targets keep the decoder's fields there
    return {
        "architectures": list(cfg.get("architectures") or []),
        "max_position_embeddings": int(text.get("max_position_embeddings") or 4096),
    }


def verifier_head(name_or_path: str | None, target=None) -> torch.Tensor | None:
    """[V, d] the verifier's output head (its embedding when tied), or None when not at hand."""
    if target is not None:
        return target.model.lm_head_weight().detach().cpu()
    d = _verifier_dir(name_or_path)
    if d is None:
        return None
    weights = open_checkpoint(d)
    for key in ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"):
        if key in weights:
            return weights[key]
    return None
