"""DFlash / DSpark in the published layout (z-lab, speculators, vLLM): both directions.

Contract:
- The published DFlash layer (z-lab `DFlashDraftModel`, speculators `DFlashDraftModel` /
  `DSparkDraftModel`, vLLM and SGLang's DFlash) is a Qwen3 layer: per-head RMSNorms `q_norm` /
  `k_norm` on queries and keys before RoPE (context and block rows alike), and mask slots that
  read the target's embedding of `mask_token_id`. Ours is that layer exactly when its config sets
  `qk_norm` and `mask_token_id` (drafters/dflash/model.py); then the tensors map one to one:
  `fc` -> `fc`, `ctx_norm` -> `hidden_norm`, `layers.{i}.*` -> `layers.{i}.*` (HF names,
  `self_attn.{q,k}_norm`), `norm` -> `norm`. Neither side stores an embedding; the head is the
  target's (stored as `lm_head.weight`, rows in increasing target id, with `d2t` offsets and a
  `t2d` mask, only for a reduced draft vocabulary: what speculators writes).
- DSpark (speculators `dspark`, vanilla Markov head, confidence head over [h ; W1[prev]]):
  `markov_head.markov_w1` [V, r] is indexed by target id, ours `W1` [Vd + 1, r] by draft id (row
  Vd: every id outside the draft vocabulary), so export spreads our rows over the target ids and
  import needs every id outside the draft vocabulary to share one row. `markov_w2` = `W2` (rows
  re-ordered), `confidence_head.proj` = `conf`. `sts_temperature` travels as the config field
  `confidence_temperatures` (ours; speculators keeps unknown fields and does not read it). A
  per-position calibration bias (`sts_bias`) has no place in the format: refused.
- Layout: speculators `sample_from_anchor` false = our "dflash" layout (slot 0 is the anchor),
  true = our "dspark" layout (every slot drafts); z-lab is always the former.
- `export_refusal(method, arch, state)` -> the reasons an export is refused (empty: it exports),
  naming the missing option and how to train one that exports.
- `to_foreign(method, arch, state, head)` -> (tensors, config fields) for speculators;
  `head` [V, d] is the target's output head (needed for a reduced draft vocabulary).
- `from_foreign(where, method, layer, state, info, target)` -> our (arch, state), `info` holding
  block_size, layer_ids (ours), mask_token_id, sample_from_anchor and the DSpark fields. Refuses
  what our network cannot compute exactly (biases, another activation, RoPE scaling, sliding
  windows, no mask token id, another head or embedding than the target's, other Markov heads)
  and a drafter for another target (common.check_target), with the reason.
Legend: d width, V target vocabulary rows, Vd draft vocabulary, r Markov rank.
"""

from __future__ import annotations

import torch

from specdecode.drafters.dflash.model import t2d_table
from specdecode.drafters.layers import HF_LAYER_NAMES, QK_NORM_NAMES
from specdecode.errors import SpecDecodeError
from specdecode.interop.common import (
    check_embedding,
    check_target,
    check_vocab_maps,
    ids_from_offsets,
    offsets_from_ids,
    rope_theta,
    sorted_vocab,
    t2d_mask,
)

LAYER_KEYS = {**HF_LAYER_NAMES, **QK_NORM_NAMES}  # ours -> theirs inside `layers.{i}.`
TOP_KEYS = {"fc.weight": "fc.weight", "ctx_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
DSPARK_KEYS = {"W2.weight": "markov_head.markov_w2.weight", "conf.weight": "confidence_head.proj.weight"}
DSPARK_KEYS |= {"conf.bias": "confidence_head.proj.bias"}


def _train_hint(method: str) -> str:
    return (
        f"train one that exports with `specdecode train {method} ...` (q/k norms and a mask token are "
        "its defaults; `--mask-token-id N` picks the token)"
    )


def export_refusal(method: str, arch: dict, state: dict[str, torch.Tensor]) -> list[str]:
    reasons = []
    if not arch.get("qk_norm"):
        reasons.append(
            "it was trained without `qk_norm`: the format's DFlash layer normalises queries and keys "
            "per head (Qwen3 q_norm / k_norm RMSNorm before RoPE) and no weights turn an RMSNorm into "
            "the identity"
        )
    if arch.get("mask_token_id") is None:
        reasons.append(
            "it was trained without `mask_token_id`: its mask slots read a learned vector (`mask_emb`), "
            "while the format's read the target's embedding of one mask_token_id"
        )
    if method == "dspark":
        bias = state.get("sts_bias")
        if bias is not None and bool((bias.float() != 0).any()):
            reasons.append(
                "its confidence head carries a per-position calibration bias (`calibrate --bias`) "
                "that the format's confidence head cannot hold (recalibrate without --bias)"
            )
    return reasons


def refuse(where: str, method: str, reasons: list[str]) -> None:
    raise SpecDecodeError(
        f"{where} cannot be converted exactly: " + "; ".join(reasons) + f". Serve it with specdecode, or "
        f"{_train_hint(method)}; docs/interop.md, 'DFlash and DSpark'"
    )


def layer_config(arch: dict, max_position: int = 4096, dtype: str = "bfloat16") -> dict:
    """The Qwen3 decoder-layer config of our DFlash layers (vocab_size = the target's rows)."""
    theta = float(arch.get("rope_theta", 10000.0))
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": arch["target_vocab_size"],
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_heads"],
        "num_key_value_heads": arch["num_kv_heads"],
        "head_dim": arch["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": max_position,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def to_foreign(
    method: str, arch: dict, state: dict[str, torch.Tensor], head: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], dict]:
    V, Vd = arch["target_vocab_size"], arch["draft_vocab_size"]
    perm = sorted_vocab(state["d2t"])
    ids = state["d2t"].long()[perm]  # [Vd] increasing target ids
    out = {theirs: state[ours] for ours, theirs in TOP_KEYS.items()}
    for i in range(arch["num_layers"]):
        out.update(
            {f"layers.{i}.{theirs}": state[f"layers.{i}.{ours}"] for ours, theirs in LAYER_KEYS.items()}
        )
    if Vd < V:
        if head is None:
            raise SpecDecodeError(
                "a reduced draft vocabulary needs the target's output head in the export (speculators "
                "stores lm_head rows for it); pass --target or a local verifier directory"
            )
        out["lm_head.weight"] = head[ids].to("cpu")  # the target's own rows, in its dtype: exact
        out["d2t"] = offsets_from_ids(ids)
        out["t2d"] = t2d_mask(ids, V)
    elif not torch.equal(ids, torch.arange(V)):
        raise SpecDecodeError(f"the {method} checkpoint's d2t is not a permutation of the target vocabulary")
    fields = {
        "block_size": arch["block_size"],
        "aux_hidden_state_layer_ids": [i + 1 for i in arch["feature_layers"]],
        "mask_token_id": arch["mask_token_id"],
        "sample_from_anchor": arch.get("layout", "dflash") == "dspark",
        "sliding_window_non_causal": False,
        "target_hidden_size": None,
    }
    if method == "dspark":
        # W1 rows by draft id (row Vd: every other id) -> rows by target id; W2 rows re-ordered.
        out["markov_head.markov_w1.weight"] = state["W1.weight"][t2d_table(state["d2t"], V)]
        out.update({theirs: state[ours] for ours, theirs in DSPARK_KEYS.items()})
        out["markov_head.markov_w2.weight"] = state["W2.weight"][perm]
        fields |= {
            "markov_rank": arch["markov_rank"],
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
            "confidence_temperatures": [float(t) for t in state["sts_temperature"].float()],
        }
    return {k: v.contiguous() for k, v in out.items()}, fields


def _check_layer(where: str, layer: dict, state: dict[str, torch.Tensor]) -> None:
    problems = []
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        problems.append("biased projections (specdecode's have no bias)")
    if any(k.startswith("layers.") and k.endswith(".bias") for k in state):
        problems.append("bias tensors in its layers")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {layer.get('hidden_act')!r} (specdecode's is silu)")
    if "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        problems.append("sliding-window attention (specdecode's DFlash attends to the whole context)")
    if problems:
        raise SpecDecodeError(f"{where} cannot be expressed as a specdecode drafter: " + "; ".join(problems))


def _check_head(where: str, theirs: torch.Tensor, ids: torch.Tensor, target) -> None:
    """A stored head must be the target's rows: specdecode's DFlash drafts with the target's head."""
    mine = target.model.lm_head_weight().detach().float().cpu()[ids]
    if theirs.shape != mine.shape or not torch.allclose(theirs.float(), mine, rtol=1e-2, atol=1e-2):
        raise SpecDecodeError(
            f"{where} stores its own output head (lm_head), which differs from the target's rows; "
            "specdecode's DFlash drafts with the target's frozen head, so it would draft differently"
        )


def _markov_from_foreign(where, state, ids, V, r) -> torch.Tensor:
    """[V, r] rows by target id -> our [Vd + 1, r] by draft id (row Vd: every other id)."""
    w1 = state["markov_head.markov_w1.weight"]
    if w1.shape != (V, r):
        raise SpecDecodeError(f"{where}: markov_w1 has shape {tuple(w1.shape)}, not ({V}, {r})")
    other = torch.ones(V, dtype=torch.bool)
    other[ids] = False
    rest = w1[other]
    if len(rest) and not bool((rest == rest[:1]).all()):
        raise SpecDecodeError(
            f"{where}: its Markov head gives tokens outside the draft vocabulary rows of their own; "
            "specdecode's keeps one shared row for them, so it would draft differently"
        )
    last = rest[:1] if len(rest) else torch.zeros(1, r, dtype=w1.dtype)
    return torch.cat([w1[ids], last])


def from_foreign(
    where: str,
    method: str,  # "dflash" | "dspark"
    layer: dict,  # the foreign Qwen3 layer config
    state: dict[str, torch.Tensor],
    info: dict,  # block_size, layer_ids (ours), mask_token_id, sample_from_anchor, draft_vocab_size, ...
    target,  # LoadedModel
) -> tuple[dict, dict[str, torch.Tensor]]:
    d, V = int(layer["hidden_size"]), int(layer["vocab_size"])
    layer_ids = list(info["layer_ids"])
    check_target(where, target, d, V, layer_ids)
    _check_layer(where, layer, state)
    n = int(layer.get("num_hidden_layers", 1))
    mask_id = info.get("mask_token_id")
    if mask_id is None:
        raise SpecDecodeError(f"{where} names no mask_token_id; the format's mask slots need one")
    if not 0 <= int(mask_id) < V:
        raise SpecDecodeError(f"{where}: mask_token_id {mask_id} is outside the target vocabulary")
    need = list(TOP_KEYS.values()) + [f"layers.{i}.{k}" for i in range(n) for k in HF_LAYER_NAMES.values()]
    missing = [k for k in need if k not in state]
    if missing:
        raise SpecDecodeError(f"{where} lacks the tensors {missing}; it is not a complete DFlash drafter")
    norms = [f"layers.{i}.{k}" for i in range(n) for k in QK_NORM_NAMES.values()]
    qk = [k in state for k in norms]
    if any(qk) and not all(qk):
        raise SpecDecodeError(f"{where} has q/k norms in some layers only; specdecode's are all or none")
    if state["fc.weight"].shape[1] != len(layer_ids) * d:
        raise SpecDecodeError(
            f"{where}: fc reads {state['fc.weight'].shape[1]} features, not {len(layer_ids)} layers x {d}"
        )
    check_embedding(where, state, target)
    Vd = int(info.get("draft_vocab_size") or V)
    if Vd < V:
        if "d2t" not in state or "lm_head.weight" not in state:
            raise SpecDecodeError(f"{where}: a reduced draft vocabulary ({Vd}) needs d2t and lm_head")
        ids = ids_from_offsets(state["d2t"])
        if len(ids) != Vd:
            raise SpecDecodeError(f"{where}: draft_vocab_size {Vd} but d2t has {len(ids)} entries")
        check_vocab_maps(where, ids, state.get("t2d"), V)
    else:
        ids = torch.arange(V)
    if "lm_head.weight" in state:
        _check_head(where, state["lm_head.weight"], ids, target)
    anchor_drafts = bool(info.get("sample_from_anchor"))
    if method == "dspark" and not anchor_drafts:
        raise SpecDecodeError(
            f"{where} sets sample_from_anchor false; specdecode's DSpark drafts from the anchor slot"
        )
    head_dim = int(layer.get("head_dim") or d // int(layer["num_attention_heads"]))
    B = int(info["block_size"])
    arch = {
        "hidden_size": d,
        "num_heads": int(layer["num_attention_heads"]),
        "num_kv_heads": int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        "head_dim": head_dim,
        "intermediate_size": int(layer["intermediate_size"]),
        "feature_layers": layer_ids,
        "draft_vocab_size": Vd,
        "target_vocab_size": V,
        "num_layers": n,
        "block_size": B,
        "layout": "dspark" if anchor_drafts else "dflash",
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta(layer, where),
        "markov_rank": 0,
        "qk_norm": all(qk),
        "mask_token_id": int(mask_id),
    }
    ours = {k: state[v] for k, v in TOP_KEYS.items()}
    for i in range(n):
        keys = LAYER_KEYS if arch["qk_norm"] else HF_LAYER_NAMES
        ours.update({f"layers.{i}.{k}": state[f"layers.{i}.{v}"] for k, v in keys.items()})
    ours["d2t"] = ids.long()
    if method == "dspark":
        ours |= _dspark_from_foreign(where, state, info, ids, V, Vd, d, B)
        arch["markov_rank"] = int(ours["W1.weight"].shape[1])
    return arch, {k: v.contiguous() for k, v in ours.items()}


def _dspark_from_foreign(where, state, info, ids, V, Vd, d, B) -> dict[str, torch.Tensor]:
    r = int(info.get("markov_rank") or 0)
    kind = info.get("markov_head_type", "vanilla")
    if r <= 0 or kind != "vanilla" or not info.get("enable_confidence_head", True):
        raise SpecDecodeError(
            f"{where}: Markov rank {r}, head type {kind!r}, confidence head "
            f"{info.get('enable_confidence_head', True)}; specdecode's DSpark has a vanilla Markov head "
            "of rank > 0 and a confidence head"
        )
    if not info.get("confidence_head_with_markov", True):
        raise SpecDecodeError(f"{where}: its confidence head does not read W1[prev]; specdecode's does")
    missing = [k for k in (*DSPARK_KEYS.values(), "markov_head.markov_w1.weight") if k not in state]
    if missing:
        raise SpecDecodeError(f"{where} lacks the tensors {missing}; it is not a complete DSpark drafter")
    if state["markov_head.markov_w2.weight"].shape != (Vd, r) or state[
        "confidence_head.proj.weight"
    ].shape != (
        1,
        d + r,
    ):
        raise SpecDecodeError(f"{where}: Markov or confidence head shapes do not match rank {r}")
    temps = info.get("confidence_temperatures") or [1.0] * B
    if len(temps) != B:
        raise SpecDecodeError(f"{where}: {len(temps)} confidence temperatures for a block of {B}")
    dtype = state["markov_head.markov_w2.weight"].dtype
    return {
        "W1.weight": _markov_from_foreign(where, state, ids, V, r),
        **{ours: state[theirs] for ours, theirs in DSPARK_KEYS.items()},
        "sts_temperature": torch.tensor(temps, dtype=dtype),
        "sts_bias": torch.zeros(B, dtype=dtype),
    }
