"""Export (issue 16): the shipped SmolLM2 EAGLE-3 drafter in the speculators and SpecForge
layouts, and the round trip export -> import on SmolLM2 (identical drafter logits, token-identical
greedy output with the same acceptance); DFlash and DSpark exports are refused with the reasons."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.checkpoint import SHIPPED_ROOT, read_weights
from specdecode.drafters.eagle import load_eagle
from specdecode.drafters.eagle.model import Eagle3, EagleConfig, ttt_forward
from specdecode.errors import SpecDecodeError
from specdecode.interop import detect_layout, export_drafter, import_drafter, write_native
from specdecode.models.loader import load_model
from specdecode.policy import FixedK

EAGLE = SHIPPED_ROOT / "smollm2-135m-eagle"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_speculators_layout_of_the_shipped_eagle(tmp_path):
    out = export_drafter(EAGLE, tmp_path / "spec", verifier_name_or_path=HUB_ID)
    cfg = json.loads((out / "config.json").read_text())
    ours = json.loads((EAGLE / "config.json").read_text())["arch"]
    assert detect_layout(out) == "speculators"
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == 8192 and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours["feature_layers"]] == [2, 15, 27]
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("llama", 1, 49152)
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"] == {"name_or_path": HUB_ID, "architectures": ["LlamaForCausalLM"]}
    w, src = load_file(str(out / "model.safetensors")), read_weights(EAGLE)  # int8 stored: dequantized
    assert w["layers.0.self_attn.q_proj.weight"].shape == (576, 2 * 576)
    assert w["fc.weight"].shape == (576, 3 * 576)
    assert "embed_tokens.weight" not in w  # vLLM shares the target's embedding
    ids = w["d2t"] + torch.arange(8192)  # offsets -> target ids, increasing
    assert torch.equal(ids, src["d2t"].sort().values) and bool((ids[1:] > ids[:-1]).all())
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 8192 and bool(w["t2d"][ids].all())
    assert torch.equal(w["lm_head.weight"], src["head.weight"][src["d2t"].argsort()])


def test_specforge_layout_of_the_shipped_eagle(tmp_path):
    out = export_drafter(EAGLE, tmp_path / "sf", fmt="specforge")
    cfg = json.loads((out / "config.json").read_text())
    assert detect_layout(out) == "specforge-eagle3" and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert "midlayer.hidden_norm.weight" in load_file(str(out / "model.safetensors"))


def test_shipped_dflash_exports_to_speculators_only(tmp_path):
    """The shipped DFlash has the published layer (q/k norms, a mask token): speculators takes it;
    SpecForge has no DFlash layout and refuses it without writing anything."""
    out = export_drafter(SHIPPED_ROOT / "smollm2-135m-dflash", tmp_path / "x")
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash"
    assert "layers.0.self_attn.q_norm.weight" in load_file(str(out / "model.safetensors"))
    with pytest.raises(SpecDecodeError):
        export_drafter(SHIPPED_ROOT / "smollm2-135m-dflash", tmp_path / "y", fmt="specforge")
    assert not (tmp_path / "y").exists()


def test_shipped_dspark_exports_to_speculators_only(tmp_path):
    """The shipped DSpark is the published layer (q/k norms, a mask token, temperature-only
    calibration): it exports to speculators with the per-algorithm fields; SpecForge has no
    DSpark layout."""
    src = SHIPPED_ROOT / "smollm2-135m-dspark"
    out = export_drafter(src, tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    arch = json.loads((src / "config.json").read_text())["arch"]
    assert cfg["speculators_model_type"] == "dspark" and cfg["mask_token_id"] == arch["mask_token_id"]
    assert cfg["block_size"] == arch["block_size"] and cfg["markov_rank"] == arch["markov_rank"]
    assert len(cfg["confidence_temperatures"]) == arch["block_size"]
    w = load_file(str(out / "model.safetensors"))
    assert "layers.0.self_attn.q_norm.weight" in w and w["lm_head.weight"].dtype == torch.float32
    with pytest.raises(SpecDecodeError, match="SpecForge has no layout"):
        export_drafter(src, tmp_path / "y", fmt="specforge")


def test_export_refuses_unknown_formats_and_non_checkpoints(tmp_path):
    with pytest.raises(SpecDecodeError, match="unknown export format"):
        export_drafter(EAGLE, tmp_path / "x", fmt="gguf")
    with pytest.raises(SpecDecodeError, match="not a directory"):
        export_drafter(tmp_path / "missing", tmp_path / "x")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(str(smollm2_dir), dtype="fp32", device="cpu")


def _logits(arch, state, target, ids, steps=3):
    """Our drafter's full-vocabulary logits [steps, T, V] on the target's own features."""
    net = Eagle3(EagleConfig.from_json(arch))
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    T, layers = ids.shape[1], list(arch["feature_layers"])
    hidden = target.model.prefill(ids, target.model.new_cache(1, T + 1), [0], capture=layers).hidden
    feats = torch.cat([hidden[i] for i in layers], -1).float()
    with torch.no_grad():
        outs = ttt_forward(net.eval(), target.model.embed, feats, ids, torch.tensor([T]), steps)
        small = torch.stack([net.logits(o)[0] for o in outs])
    full = torch.full((*small.shape[:2], arch["target_vocab_size"]), float("-inf"))
    full[..., state["d2t"]] = small
    return full


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_round_trip_on_smollm2_is_exact(smollm2, tmp_path, fmt):
    out = export_drafter(EAGLE, tmp_path / fmt, fmt=fmt)
    method, arch, state = import_drafter(out, smollm2)
    _, arch0, state0 = import_drafter(EAGLE, smollm2)
    assert method == "eagle" and arch == {**arch0, "feature_layers": list(arch0["feature_layers"])}
    prompt = "Write a Python function that reverses a string."
    ids = torch.tensor(smollm2.tokenizer(prompt)["input_ids"])[None]
    assert torch.equal(_logits(arch, state, smollm2, ids), _logits(arch0, state0, smollm2, ids))

    if fmt != "speculators":
        return  # the same weights as the speculators export under other names: one decode suffices
    chat = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )["input_ids"]

    def run(path):
        dec = SpeculativeDecoder(smollm2, load_eagle(path, smollm2), FixedK(4), max_batch=1)
        return dec.generate([GenerationRequest(chat, SamplingParams(), 24, ignore_eos=True)])[0]

    native = write_native(out, smollm2, tmp_path / "native")
    a, b = run(EAGLE), run(native)
    assert a.token_ids == b.token_ids and a.tau == b.tau and a.tau > 1.0
