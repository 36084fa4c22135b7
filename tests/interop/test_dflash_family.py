"""DFlash / DSpark interop (issue 16): with `qk_norm` and `mask_token_id` our layer is the
published one, so a z-lab DFlash checkpoint imports and drafts what the published layer computes,
our DFlash / DSpark export to speculators and import back with identical drafter logits, and
decoding with such a drafter stays exactly the target's greedy output. Checkpoints without the
options still load as before; what stays inexpressible is refused with the reason."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdecode.build import LoadOptions, build
from specdecode.drafters.checkpoint import SHIPPED_ROOT, read_weights, save_checkpoint
from specdecode.drafters.dflash.model import DFlash, DFlashConfig, t2d_table
from specdecode.drafters.dspark.model import DSpark
from specdecode.errors import SpecDecodeError
from specdecode.interop import detect_layout, export_drafter, import_drafter

MASK_ID = 5
PROMPT = "def add(a, b):"


def published_dflash_block(cfg, w, feats, anchor_id, embed, head, mask_id, block_size):
    """The z-lab / speculators DFlash layer written out from its published definition (Qwen3
    layers: q_norm / k_norm per head before RoPE; keys/values = [k/v_proj(hidden_norm(fc(feats)))
    ; k/v_proj(input_layernorm(block))]; the block at positions T.. after T context rows, non-causal;
    slot 0 = embed(anchor), the others = embed(mask_token_id)). feats [T, n d] -> logits [B, V]."""
    eps, T, B = cfg["rms_norm_eps"], feats.shape[0], block_size
    H, Hk, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, D, 2).float() / D)

    def rope(t, pos):
        ang = pos.float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        return t * cos + torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1) * sin

    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = embed[torch.tensor([anchor_id] + [mask_id] * (B - 1))]
    pos_ctx, pos_blk = torch.arange(T), T + torch.arange(B)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(B, H, D), w[p + "self_attn.q_norm.weight"])
        k = torch.cat([ctx, x]) @ w[p + "self_attn.k_proj.weight"].T
        k = rms(k.view(T + B, Hk, D), w[p + "self_attn.k_norm.weight"])
        v = (torch.cat([ctx, x]) @ w[p + "self_attn.v_proj.weight"].T).view(T + B, Hk, D)
        q, k = rope(q, pos_blk), rope(k, torch.cat([pos_ctx, pos_blk]))
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        h = h + o.transpose(0, 1).reshape(B, H * D) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]) @ head.T


def our_block(method, arch, state, feats, anchor_id, prev_ids, target):
    """Our network on one block after T context rows: (full-vocabulary logits [B, V] of every
    slot, with the Markov correction given `prev_ids` [B] for DSpark; confidences [B] or None)."""
    net = (DSpark if method == "dspark" else DFlash)(DFlashConfig.from_json(arch))
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    net.eval()
    embed = target.model.embed
    T, B = feats.shape[0], arch["block_size"]
    with torch.no_grad():
        kv = net.context_kv(net.fuse(feats[None].float()), torch.arange(T)[None])
        block = net.block_input(embed(torch.tensor([[anchor_id]])), net.mask_vector(embed))
        pos = (T + torch.arange(B))[None, None]
        states = net.block_states(block, pos, kv, torch.ones(1, 1, T, dtype=torch.bool))[0, 0]  # [B, d]
        head = target.model.lm_head_weight().float()[net.d2t]
        small, conf = net.logits(states, head), None
        if method == "dspark":
            prev = t2d_table(net.d2t, arch["target_vocab_size"])[prev_ids]
            small = net.markov_logits(small, prev)
            conf = torch.sigmoid(net.confidence_logit(states, prev) / net.sts_temperature)
    full = torch.full((B, arch["target_vocab_size"]), float("-inf"))
    full[:, net.d2t] = small
    return full, conf


def our_checkpoint(tiny, path, method, Vd=96, seed=0, bias=False, **arch):
    """A DFlash / DSpark checkpoint for `tiny` with qk_norm and mask_token_id (unless `arch`
    overrides them), seeded random weights (norms away from 1) and a random draft vocabulary."""
    info = tiny.model.info
    kw = {"qk_norm": True, "mask_token_id": MASK_ID, **arch}
    if method == "dspark":
        kw |= {"layout": "dspark", "markov_rank": 8}
    cfg = DFlashConfig.for_target(info, tiny.config, Vd, num_layers=2, block_size=4, **kw)
    net = (DSpark if method == "dspark" else DFlash)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(("norm" in name) + 0.2 * torch.randn(p.shape, generator=g))
        net.d2t.copy_(torch.randperm(info.vocab_size, generator=g)[:Vd])
        if method == "dspark":
            net.sts_temperature.copy_(0.5 + torch.rand(cfg.block_size, generator=g))
            if bias:
                net.sts_bias.fill_(0.3)
    save_checkpoint(path, method, cfg.to_json(), net.state_dict(), tiny, dtype=torch.float32)
    return path


def _inputs(arch, seed=1, T=9):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(T, len(arch["feature_layers"]) * arch["hidden_size"], generator=g)
    return feats, 17, torch.randint(0, 300, (arch["block_size"],), generator=g)


def test_zlab_dflash_imports_and_drafts_what_the_published_layer_computes(tiny, zlab_dir):
    path = zlab_dir(block_size=6)
    assert detect_layout(path) == "zlab-dflash"
    method, arch, state = import_drafter(path, tiny)
    assert method == "dflash" and arch["qk_norm"] and arch["mask_token_id"] == MASK_ID
    assert arch["feature_layers"] == [0, 1, 2] and arch["layout"] == "dflash" and arch["block_size"] == 6
    assert arch["draft_vocab_size"] == arch["target_vocab_size"] == 448  # z-lab drafts the full vocabulary
    cfg, w = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    feats, anchor, _ = _inputs(arch)
    embed = tiny.model.embed(torch.arange(448)).float()
    head = tiny.model.lm_head_weight().float()
    theirs = published_dflash_block(cfg, w, feats, anchor, embed, head, MASK_ID, 6)
    ours, _ = our_block(method, arch, state, feats, anchor, None, tiny)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_speculators_round_trip_gives_identical_drafter_logits(tiny, tmp_path, method):
    src = our_checkpoint(tiny, tmp_path / "ours", method)
    out = export_drafter(src, tmp_path / "spec", target=tiny)
    cfg = json.loads((out / "config.json").read_text())
    assert detect_layout(out) == "speculators" and cfg["speculators_model_type"] == method
    assert cfg["architectures"] == ["DFlashSpeculator" if method == "dflash" else "DSparkSpeculator"]
    ours_arch = json.loads((src / "config.json").read_text())["arch"]
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in ours_arch["feature_layers"]]
    assert cfg["mask_token_id"] == MASK_ID and cfg["block_size"] == 4 and cfg["draft_vocab_size"] == 96
    assert cfg["sample_from_anchor"] is (method == "dspark")
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("qwen3", 2, 448)
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == method and sc["proposal_methods"][0]["speculative_tokens"] <= 4
    w = load_file(str(out / "model.safetensors"))
    assert w["layers.1.self_attn.q_norm.weight"].shape == (tiny.model.info.head_dim,)
    assert w["lm_head.weight"].shape == (96, 64) and w["t2d"].sum() == 96 and "hidden_norm.weight" in w
    if method == "dspark":
        assert cfg["markov_rank"] == 8 and cfg["enable_confidence_head"] is True
        assert len(cfg["confidence_temperatures"]) == 4
        assert w["markov_head.markov_w1.weight"].shape == (448, 8)

    m2, arch2, state2 = import_drafter(out, tiny)
    _, arch0, state0 = import_drafter(src, tiny)
    assert m2 == method and DFlashConfig.from_json(arch2) == DFlashConfig.from_json(arch0)
    feats, anchor, prev = _inputs(arch0)
    a, ca = our_block(method, arch0, state0, feats, anchor, prev, tiny)
    b, cb = our_block(method, arch2, state2, feats, anchor, prev, tiny)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if method == "dspark":
        torch.testing.assert_close(ca, cb, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_greedy_output_with_an_exportable_drafter_is_the_target_greedy_output(tiny, tmp_path, method):
    src = our_checkpoint(tiny, tmp_path / "ours", method)
    foreign = export_drafter(src, tmp_path / "spec", target=tiny)

    def greedy(m, drafter=None):
        opts = LoadOptions(target=tiny, method=m, drafter=drafter, policy="fixed", num_draft_tokens=3)
        return build(opts).generate(PROMPT, max_new_tokens=20, temperature=0.0).token_ids

    ar = greedy("ar")
    assert greedy(method, str(src)) == ar
    assert greedy(method, str(foreign)) == ar  # the speculators directory, converted on load


def test_zlab_dir_decodes_exactly(tiny, zlab_dir):
    drafter = str(zlab_dir())
    opts = LoadOptions(target=tiny, method="dflash", drafter=drafter, policy="fixed", num_draft_tokens=3)
    got = build(opts).generate(PROMPT, max_new_tokens=20, temperature=0.0).token_ids
    ar = build(LoadOptions(target=tiny, method="ar")).generate(PROMPT, max_new_tokens=20, temperature=0.0)
    assert got == ar.token_ids


def test_checkpoints_without_the_options_keep_their_layer(tiny, tmp_path):
    """An arch from before the options (no qk_norm / mask_token_id keys) builds the same network:
    a learned mask vector, no q/k norms, the same state-dict keys."""
    src = our_checkpoint(tiny, tmp_path / "plain", "dflash", qk_norm=False, mask_token_id=None)
    arch = json.loads((src / "config.json").read_text())["arch"]
    old = {k: v for k, v in arch.items() if k not in ("qk_norm", "mask_token_id")}
    net = DFlash(DFlashConfig.from_json(old))
    assert not net.cfg.qk_norm and net.cfg.mask_token_id is None
    keys = set(net.state_dict())
    assert "mask_emb" in keys and not any("q_norm" in k or "k_norm" in k for k in keys)
    assert keys == set(read_weights(src))  # the old checkpoint's own weights fit it
    shipped = json.loads((SHIPPED_ROOT / "smollm2-135m-dflash" / "config.json").read_text())["arch"]
    assert shipped["qk_norm"]  # the shipped DFlash has the published layer (exportable)
    assert set(DFlash(DFlashConfig.from_json(shipped)).state_dict()) == set(
        read_weights(SHIPPED_ROOT / "smollm2-135m-dflash")
    )
    with pytest.raises(SpecDecodeError, match="mask_token_id 9999 is not a row"):
        DFlashConfig.from_json({**old, "mask_token_id": 9999})


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_exports_without_the_options_are_refused_naming_them(tiny, tmp_path, method):
    plain = our_checkpoint(tiny, tmp_path / "plain", method, qk_norm=False, mask_token_id=None)
    with pytest.raises(SpecDecodeError, match="without `qk_norm`") as e:
        export_drafter(plain, tmp_path / "x", target=tiny)
    msg = str(e.value)
    assert "without `mask_token_id`" in msg
    assert f"specdecode train {method} ...` (q/k norms and a mask token are its defaults" in msg
    assert not (tmp_path / "x").exists()
    with pytest.raises(SpecDecodeError, match="SpecForge has no layout"):
        export_drafter(plain, tmp_path / "y", fmt="specforge")


@pytest.mark.slow
def test_shipped_dspark_round_trip_on_smollm2_is_exact(smollm2_dir, tmp_path):
    """The shipped DSpark exports to speculators; imported back it has the same weights, drafter
    logits and confidences, and gives token-identical greedy output on SmolLM2."""
    from specdecode.models.loader import load_model

    target = load_model(str(smollm2_dir), dtype="fp32", device="cpu")
    shipped = SHIPPED_ROOT / "smollm2-135m-dspark"
    out = export_drafter(shipped, tmp_path / "spec", target=target)
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dspark"
    m0, arch0, state0 = import_drafter(shipped, target)
    m1, arch1, state1 = import_drafter(out, target)
    assert m0 == m1 == "dspark" and set(state0) == set(state1)
    assert all(torch.equal(state0[k], state1[k]) for k in state0)
    feats, anchor, prev = _inputs(arch0)
    a, ca = our_block("dspark", arch0, state0, feats, anchor, prev, target)
    b, cb = our_block("dspark", arch1, state1, feats, anchor, prev, target)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(ca, cb, atol=0, rtol=0)

    def greedy(method, drafter=None):
        opts = LoadOptions(target=target, method=method, drafter=drafter, policy="fixed", num_draft_tokens=4)
        return build(opts).generate(PROMPT, max_new_tokens=24, temperature=0.0).token_ids

    assert greedy("dspark") == greedy("dspark", str(out)) == greedy("ar")


def test_what_stays_inexpressible_is_refused_with_the_reason(tiny, tmp_path, zlab_dir):
    only_qk = our_checkpoint(tiny, tmp_path / "qk", "dflash", mask_token_id=None)
    with pytest.raises(SpecDecodeError, match="without `mask_token_id`") as e:
        export_drafter(only_qk, tmp_path / "x", target=tiny)
    assert "qk_norm" not in str(e.value).split("Serve it")[0]
    biased = our_checkpoint(tiny, tmp_path / "b", "dspark", bias=True)
    with pytest.raises(SpecDecodeError, match="calibration bias"):
        export_drafter(biased, tmp_path / "x", target=tiny)
    with pytest.raises(SpecDecodeError, match="names no mask_token_id"):
        import_drafter(zlab_dir("nomask", dflash_config={"target_layer_ids": [0, 1, 2]}), tiny)
    with pytest.raises(SpecDecodeError, match=r"feature layers \[5\]"):
        far = {"mask_token_id": 5, "target_layer_ids": [0, 1, 5]}
        import_drafter(zlab_dir("far", dflash_config=far), tiny)
    with pytest.raises(SpecDecodeError, match="sliding-window"):
        import_drafter(zlab_dir("sw", layer_types=["sliding_attention"]), tiny)

    # speculators DSpark whose Markov head gives off-vocabulary tokens rows of their own
    out = export_drafter(our_checkpoint(tiny, tmp_path / "s", "dspark"), tmp_path / "spec", target=tiny)
    w = load_file(str(out / "model.safetensors"))
    w["markov_head.markov_w1.weight"] = torch.randn_like(w["markov_head.markov_w1.weight"])
    from safetensors.torch import save_file

    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="one shared row"):
        import_drafter(out, tiny)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "markov_head_type": "gated"}))
    with pytest.raises(SpecDecodeError, match="vanilla Markov head"):
        import_drafter(out, tiny)
    head = load_file(str(out / "model.safetensors"))
    head["lm_head.weight"] = head["lm_head.weight"] + 1.0
    save_file(head, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecDecodeError, match="own output head"):
        import_drafter(out, tiny)
