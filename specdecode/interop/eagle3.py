"""EAGLE-3 weights and layer config in the layout vLLM, SGLang, SpecForge and speculators share.

Contract:
- Their EAGLE-3 drafter is ours: `fc` (3d -> d), ONE Llama decoder layer whose q/k/v read
  [input_layernorm(Emb(token)) ; hidden_norm(feature)] (2d) with the UN-normed feature as the
  residual (`norm_before_residual: false`), a final `norm`, `lm_head` over the draft vocabulary
  and `d2t` / `t2d` maps (common.py). The embedding is the target's (not stored by us).
- `to_foreign(arch, state, prefix)` -> tensors named `fc.weight`, `{prefix}input_layernorm`,
  `{prefix}hidden_norm`, `{prefix}self_attn.{q,k,v,o}_proj`, `{prefix}post_attention_layernorm`,
  `{prefix}mlp.{gate,up,down}_proj`, `norm.weight`, `lm_head.weight`, `d2t` (offsets) and `t2d`
  (bool mask) when the draft vocabulary is reduced; draft ids re-ordered by target id (the head
  rows with them), which changes no logit. `prefix` is "layers.0." (speculators, vLLM) or
  "midlayer." (SpecForge, SGLang).
- `layer_config(arch, max_position)` -> the Llama `transformer_layer_config` dict of that layer.
- `from_foreign(where, layer, state, prefix, draft_vocab_size, layer_ids, target)` -> our (arch,
  state). `layer` is the foreign Llama layer config. It refuses what our network cannot compute
  exactly: more than one layer, a non-Llama layer (Qwen3 q/k norms), biases, another activation,
  RoPE scaling, sliding windows, a feature count other than 3, a stored embedding that is not
  the target's, and a drafter for another target (common.check_target).
Legend: d width, V target vocabulary rows, Vd draft vocabulary.
"""

from __future__ import annotations

import torch

from specdecode.drafters.layers import HF_LAYER_NAMES
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

# our Eagle3 parameter -> its name inside the foreign decoder layer (EAGLE-3 adds the feature norm)
LAYER_KEYS = {**HF_LAYER_NAMES, "hidden_norm.weight": "hidden_norm.weight"}
TOP_KEYS = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "head.weight": "lm_head.weight"}


def layer_config(arch: dict, max_position: int = 4096, dtype: str = "bfloat16") -> dict:
    """The Llama decoder-layer config of our EAGLE-3 layer (vocab_size = the target's rows)."""
    theta = float(arch.get("rope_theta", 10000.0))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": arch["target_vocab_size"],
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": arch["num_heads"],
        "num_key_value_heads": arch["num_kv_heads"],
        "head_dim": arch["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": theta,  # older readers (vLLM < transformers 5 configs, SGLang)
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": max_position,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def to_foreign(arch: dict, state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    missing = [k for k in (*LAYER_KEYS, *TOP_KEYS, "d2t") if k not in state]
    if missing:
        raise SpecDecodeError(f"the EAGLE checkpoint lacks {missing}; it is incomplete")
    perm = sorted_vocab(state["d2t"])
    ids = state["d2t"].long()[perm]  # [Vd] increasing target ids
    out = {prefix + theirs: state[ours] for ours, theirs in LAYER_KEYS.items()}
    out.update({theirs: state[ours] for ours, theirs in TOP_KEYS.items()})
    out["lm_head.weight"] = state["head.weight"][perm]
    if len(ids) < arch["target_vocab_size"]:
        out["d2t"] = offsets_from_ids(ids)
        out["t2d"] = t2d_mask(ids, arch["target_vocab_size"])
    elif not torch.equal(ids, torch.arange(len(ids))):
        raise SpecDecodeError("the EAGLE checkpoint's d2t is not a permutation of the target vocabulary")
    return {k: v.contiguous() for k, v in out.items()}


def check_layer(where: str, layer: dict) -> None:
    """Refuse a foreign decoder layer our Eagle3 layer cannot compute exactly."""
    problems = []
    if layer.get("model_type", "llama") not in ("llama", "mistral"):
        problems.append(
            f"its layer is {layer.get('model_type')!r} (specdecode's is a Llama layer: no q/k norms)"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        problems.append(f"{layer.get('num_hidden_layers')} decoder layers (specdecode's EAGLE-3 has one)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        problems.append("biased projections (specdecode's have no bias)")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {layer.get('hidden_act')!r} (specdecode's is silu)")
    if "sliding_attention" in (layer.get("layer_types") or []):
        problems.append("sliding-window attention")
    if problems:
        why = "; ".join(problems)
        raise SpecDecodeError(f"{where} cannot be expressed as a specdecode EAGLE-3 drafter: {why}")


def from_foreign(
    where: str,
    layer: dict,  # the foreign Llama layer config
    state: dict[str, torch.Tensor],
    prefix: str,
    draft_vocab_size: int,
    layer_ids: list[int],  # ours: 0-based target decoder layers whose OUTPUT is a feature
    target,  # LoadedModel
) -> tuple[dict, dict[str, torch.Tensor]]:
    check_layer(where, layer)
    d, V = int(layer["hidden_size"]), int(layer["vocab_size"])
    check_target(where, target, d, V, layer_ids)
    if len(layer_ids) != 3:
        raise SpecDecodeError(
            f"{where} fuses {len(layer_ids)} target layers; specdecode's EAGLE-3 fuses exactly 3"
        )
    need = [prefix + k for k in LAYER_KEYS.values()] + list(TOP_KEYS.values())
    missing = [k for k in need if k not in state]
    if missing:
        raise SpecDecodeError(f"{where} lacks the tensors {missing}; it is not a complete EAGLE-3 drafter")
    if state["fc.weight"].shape[1] != 3 * d:
        raise SpecDecodeError(f"{where}: fc reads {state['fc.weight'].shape[1]} features, not 3 x {d}")
    check_embedding(where, state, target)
    if draft_vocab_size < V:
        if "d2t" not in state:
            raise SpecDecodeError(f"{where}: a reduced draft vocabulary ({draft_vocab_size}) needs d2t")
        ids = ids_from_offsets(state["d2t"])
    else:
        ids = torch.arange(V)
    if len(ids) != draft_vocab_size or state["lm_head.weight"].shape[0] != draft_vocab_size:
        raise SpecDecodeError(
            f"{where}: draft_vocab_size {draft_vocab_size}, d2t has {len(ids)} entries and lm_head "
            f"{state['lm_head.weight'].shape[0]} rows; they must agree"
        )
    check_vocab_maps(where, ids, state.get("t2d") if draft_vocab_size < V else None, V)
    ours = {k: state[prefix + v] for k, v in LAYER_KEYS.items()}
    ours.update({k: state[v] for k, v in TOP_KEYS.items()})
    ours["d2t"] = ids.long()
    q_rows = state[prefix + "self_attn.q_proj.weight"].shape[0]
    head_dim = int(layer.get("head_dim") or d // int(layer["num_attention_heads"]))
    if q_rows != int(layer["num_attention_heads"]) * head_dim:
        raise SpecDecodeError(f"{where}: q_proj has {q_rows} rows, not heads x head_dim")
    arch = {
        "hidden_size": d,
        "num_heads": int(layer["num_attention_heads"]),
        "num_kv_heads": int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        "head_dim": head_dim,
        "intermediate_size": int(layer["intermediate_size"]),
        "feature_layers": list(layer_ids),
        "draft_vocab_size": int(draft_vocab_size),
        "target_vocab_size": V,
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta(layer, where),
    }
    return arch, {k: v.contiguous() for k, v in ours.items()}
