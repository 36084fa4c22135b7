"""Import of foreign drafters (issue 16): SpecForge and speculators EAGLE-3 become our Eagle3 and
draft exactly what the published layer computes; other targets and unknown layouts are refused
with the reason (z-lab DFlash and the speculators DFlash family: test_dflash_family.py)."""

import json

import pytest
import torch
import torch.nn.functional as F
from foreign_fixtures import eagle3_tensors, tiny_layer, write

from specdecode.drafters.eagle import load_eagle
from specdecode.drafters.eagle.model import Eagle3, EagleConfig, ttt_forward
from specdecode.errors import SpecDecodeError
from specdecode.interop import detect_layout, import_drafter, write_native


def published_eagle3_step0(cfg, w, prefix, feats, row_ids, embed):
    """The SpecForge / speculators EAGLE-3 layer written out from its published definition
    (Llama layer, q/k/v over [input_layernorm(emb) ; hidden_norm(fc(feats))], residual = fc(feats),
    RoPE at positions t + 1, causal), full-vocabulary logits via d2t offsets. [T, 3d] -> [T, V]."""
    eps, T = cfg["rms_norm_eps"], feats.shape[0]
    H, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    h = feats @ w["fc.weight"].T
    e = rms(embed[row_ids], w[prefix + "input_layernorm.weight"])
    x = torch.cat([e, rms(h, w[prefix + "hidden_norm.weight"])], -1)
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(T, H, D)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(T, Hk, D)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(T, Hk, D)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, D, 2).float() / D)
    ang = (torch.arange(T) + 1).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = h + o.transpose(0, 1).reshape(T, H * D) @ w[prefix + "self_attn.o_proj.weight"].T
    m = rms(y, w[prefix + "post_attention_layernorm.weight"])
    y = (
        y
        + (F.silu(m @ w[prefix + "mlp.gate_proj.weight"].T) * (m @ w[prefix + "mlp.up_proj.weight"].T))
        @ w[prefix + "mlp.down_proj.weight"].T
    )
    small = rms(y, w["norm.weight"]) @ w["lm_head.weight"].T  # [T, Vd]
    full = torch.full((T, cfg["vocab_size"]), float("-inf"))
    full[:, w["d2t"] + torch.arange(len(w["d2t"]))] = small
    return full


def ours_step0(arch, state, feats, ids, target):
    net = Eagle3(EagleConfig.from_json(arch))
    net.load_state_dict(state)
    with torch.no_grad():
        n = torch.tensor([len(ids)])
        out = ttt_forward(net.eval(), target.model.embed, feats[None], ids[None], n, 1)[0]
        small = net.logits(out)[0]
    full = torch.full((len(ids), arch["target_vocab_size"]), float("-inf"))
    full[:, state["d2t"]] = small
    return full


def test_specforge_eagle3_imports_and_drafts_what_the_published_layer_computes(tiny, specforge_dir, tmp_path):
    from safetensors.torch import load_file

    path = specforge_dir(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 0]})
    assert detect_layout(path) == "specforge-eagle3"
    method, arch, state = import_drafter(path, tiny)
    assert method == "eagle" and arch["feature_layers"] == [1, 2, 0] and arch["draft_vocab_size"] == 96
    w, cfg = load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 400, (12,), generator=g)
    feats = torch.randn(12, 3 * arch["hidden_size"], generator=g)
    row_ids = F.pad(ids[1:], (0, 1))
    ref = published_eagle3_step0(cfg, w, "midlayer.", feats, row_ids, tiny.model.embed(torch.arange(448)))
    got = ours_step0(arch, state, feats, ids, tiny)
    assert torch.equal(torch.isinf(ref), torch.isinf(got))
    assert torch.allclose(ref[~torch.isinf(ref)], got[~torch.isinf(got)], atol=1e-4)
    # written as one of our checkpoints, it loads with our loader and keeps its fp32 weights
    native = write_native(path, tiny, tmp_path / "native")
    assert detect_layout(native) == "specdecode"
    assert load_eagle(native, tiny).net.fc.weight.dtype == torch.float32
    assert torch.equal(import_drafter(native, tiny)[2]["fc.weight"], state["fc.weight"])


def test_speculators_eagle3_ids_are_hidden_state_boundaries(tiny, tmp_path):
    i = tiny.model.info
    shape = (i.hidden_size, i.num_heads, i.num_kv_heads, i.head_dim, 96, i.vocab_size, 64)
    t = eagle3_tensors(*shape, "layers.0.")
    cfg = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": tiny_layer(tiny),
        "draft_vocab_size": 64,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [], "verifier": {}},
    }
    path = write(tmp_path / "spec", cfg, t)
    assert detect_layout(path) == "speculators"
    method, arch, state = import_drafter(path, tiny)
    assert method == "eagle" and arch["feature_layers"] == [0, 1, 2]
    assert torch.equal(state["d2t"], t["d2t"] + torch.arange(64))  # offsets -> our target ids
    write(tmp_path / "nbr", {**cfg, "norm_before_residual": True}, t)
    with pytest.raises(SpecDecodeError, match="norm_before_residual"):
        import_drafter(tmp_path / "nbr", tiny)
    write(tmp_path / "qwen3", {**cfg, "transformer_layer_config": tiny_layer(tiny, model_type="qwen3")}, t)
    with pytest.raises(SpecDecodeError, match="q/k norms"):
        import_drafter(tmp_path / "qwen3", tiny)
    write(tmp_path / "mtp", {**cfg, "speculators_model_type": "mtp"}, t)
    with pytest.raises(SpecDecodeError, match="no drafter of type 'mtp'"):
        import_drafter(tmp_path / "mtp", tiny)


def test_foreign_drafters_for_another_target_are_refused(tiny, specforge_dir, zlab_dir):
    with pytest.raises(SpecDecodeError, match=r"another target: vocabulary of 500 rows \(the target has 448"):
        import_drafter(specforge_dir("v", vocab_size=500), tiny)
    with pytest.raises(SpecDecodeError, match="another target: hidden size 32"):
        import_drafter(specforge_dir("h", hidden_size=32), tiny)
    with pytest.raises(SpecDecodeError, match=r"feature layers \[7\]"):
        import_drafter(specforge_dir("l", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}), tiny)
    with pytest.raises(SpecDecodeError, match="differs from the target's"):
        ids = {"eagle_aux_hidden_state_layer_ids": [1, 2, 0]}
        import_drafter(specforge_dir("e", embed=torch.zeros(448, 64), eagle_config=ids), tiny)
    with pytest.raises(SpecDecodeError, match="built for a target with 36 layers"):
        import_drafter(zlab_dir("z36", num_target_layers=36), tiny)
    with pytest.raises(SpecDecodeError, match="another target: hidden size 32"):
        import_drafter(zlab_dir("z32", hidden=32), tiny)


def test_unknown_layouts_are_refused(tiny, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert detect_layout(tmp_path / "hf") is None and detect_layout(tmp_path / "nothing") is None
    with pytest.raises(SpecDecodeError, match="not a drafter layout specdecode reads"):
        import_drafter(tmp_path / "hf", tiny)
    with pytest.raises(SpecDecodeError, match="has no config.json"):
        import_drafter(tmp_path / "nothing", tiny)
