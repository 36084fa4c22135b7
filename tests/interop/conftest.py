"""Fixtures for the interop tests: tiny fp32 targets and foreign checkpoints built here from the
published config layouts (SpecForge configs/llama3-8B-eagle3.json, z-lab's DFlashDraftModel
config, a speculators eagle3 config), at the tiny target's shapes, with seeded random weights."""

import pytest
import torch
from foreign_fixtures import _w, eagle3_tensors, tiny_layer, write

from specdecode.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")


@pytest.fixture
def specforge_dir(tiny, tmp_path):
    """A SpecForge EAGLE-3 checkpoint (LlamaForCausalLMEagle3, midlayer.*, embed_tokens stored)."""

    def make(name="specforge", Vd=96, embed=None, **over):
        i = tiny.model.info
        arch = ["LlamaForCausalLMEagle3"]
        cfg = {**tiny_layer(tiny), "architectures": arch, "draft_vocab_size": Vd, **over}
        shape = (i.hidden_size, i.num_heads, i.num_kv_heads, i.head_dim, 96, i.vocab_size, Vd)
        t = eagle3_tensors(*shape, "midlayer.")
        t["embed_tokens.weight"] = tiny.model.embed(torch.arange(i.vocab_size)) if embed is None else embed
        return write(tmp_path / name, cfg, t)

    return make


@pytest.fixture
def zlab_dir(tiny, tmp_path):
    """A z-lab DFlash checkpoint (DFlashDraftModel + dflash_config, Qwen3 layers with q/k norms, no
    embedding and no head: both are the target's), norms away from 1 so that every weight matters."""

    def make(name="zlab", num_target_layers=None, hidden=None, **over):
        i = tiny.model.info
        d = hidden or i.hidden_size
        g = torch.Generator().manual_seed(1)
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": 8,
            "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1, 2]},
            "num_target_layers": num_target_layers or i.num_layers,
            "hidden_size": d,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": i.num_heads,
            "num_key_value_heads": i.num_kv_heads,
            "head_dim": i.head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "vocab_size": i.vocab_size,
            "tie_word_embeddings": False,
            **over,
        }
        hd, H, Hk = i.head_dim, i.num_heads, i.num_kv_heads
        t = {
            "fc.weight": _w(d, 3 * d, g=g),
            "hidden_norm.weight": 1 + _w(d, g=g, scale=0.3),
            "norm.weight": 1 + _w(d, g=g, scale=0.3),
            "layers.0.self_attn.q_proj.weight": _w(H * hd, d, g=g),
            "layers.0.self_attn.k_proj.weight": _w(Hk * hd, d, g=g),
            "layers.0.self_attn.v_proj.weight": _w(Hk * hd, d, g=g),
            "layers.0.self_attn.o_proj.weight": _w(d, H * hd, g=g),
            "layers.0.self_attn.q_norm.weight": 1 + _w(hd, g=g, scale=0.3),
            "layers.0.self_attn.k_norm.weight": 1 + _w(hd, g=g, scale=0.3),
            "layers.0.input_layernorm.weight": 1 + _w(d, g=g, scale=0.3),
            "layers.0.post_attention_layernorm.weight": 1 + _w(d, g=g, scale=0.3),
            "layers.0.mlp.gate_proj.weight": _w(96, d, g=g),
            "layers.0.mlp.up_proj.weight": _w(96, d, g=g),
            "layers.0.mlp.down_proj.weight": _w(d, 96, g=g),
        }
        return write(tmp_path / name, cfg, t)

    return make
