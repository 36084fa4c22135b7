"""Builders of foreign drafter checkpoints for the interop tests, at a tiny target's shapes,
from the published config layouts (SpecForge configs/llama3-8B-eagle3.json, a speculators
eagle3 config.json), with seeded random weights."""

import json

import torch
from safetensors.torch import save_file


def _w(*shape, g, scale=0.1):
    return scale * torch.randn(*shape, generator=g)


def eagle3_tensors(d, heads, kv, hd, inter, V, Vd, prefix, seed=0):
    """EAGLE-3 weights under the foreign names; d2t offsets / t2d mask of a random sorted subset."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "fc.weight": _w(d, 3 * d, g=g),
        f"{prefix}input_layernorm.weight": 1 + _w(d, g=g, scale=0.3),
        f"{prefix}hidden_norm.weight": 1 + _w(d, g=g, scale=0.3),
        f"{prefix}self_attn.q_proj.weight": _w(heads * hd, 2 * d, g=g),
        f"{prefix}self_attn.k_proj.weight": _w(kv * hd, 2 * d, g=g),
        f"{prefix}self_attn.v_proj.weight": _w(kv * hd, 2 * d, g=g),
        f"{prefix}self_attn.o_proj.weight": _w(d, heads * hd, g=g),
        f"{prefix}post_attention_layernorm.weight": 1 + _w(d, g=g, scale=0.3),
        f"{prefix}mlp.gate_proj.weight": _w(inter, d, g=g),
        f"{prefix}mlp.up_proj.weight": _w(inter, d, g=g),
        f"{prefix}mlp.down_proj.weight": _w(d, inter, g=g),
        "norm.weight": 1 + _w(d, g=g, scale=0.3),
        "lm_head.weight": _w(Vd, d, g=g, scale=0.5),
    }
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t["d2t"] = ids - torch.arange(Vd)
    t["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    return t


def tiny_layer(target, **over) -> dict:
    i = target.model.info
    cfg = {
        "model_type": "llama",
        "hidden_size": i.hidden_size,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": i.num_heads,
        "num_key_value_heads": i.num_kv_heads,
        "head_dim": i.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "vocab_size": i.vocab_size,
        "tie_word_embeddings": False,
    }
    return {**cfg, **over}


def write(path, cfg, tensors):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
