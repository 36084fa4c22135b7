"""load_model: directories (single, sharded, .bin), aliases, bad paths, hub ids; fingerprints."""

import json
import shutil

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.hf_adapter import HFAdapter
from specdecode.models.loader import (
    LoadedModel,
    load_model,
    model_fingerprint,
    same_tokenizer,
    tokenizer_fingerprint,
)
from specdecode.models.native import NativeDecoder


def _aliases():
    try:
        from specdecode.assets import MODELS
    except ImportError:
        return None
    return list(MODELS)


def _logits(lm, n=6):
    ids = torch.arange(3, 3 + n)[None]
    return lm.model.forward(ids, None, lm.model.new_cache(1, 16), [0]).logits


def test_local_directory(tiny_llama_dir, tiny_qwen2_dir, tiny_tokenizer_dir):
    lm = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    assert isinstance(lm, LoadedModel) and isinstance(lm.model, NativeDecoder)
    assert lm.path == tiny_llama_dir and lm.name == str(tiny_llama_dir)
    assert lm.vocab_size == len(lm.tokenizer) == 400 and lm.model.info.vocab_size == 448
    assert lm.tokenizer.eos_token_id in lm.eos_token_ids
    assert lm.model.info.device == torch.device("cpu")
    other = load_model(tiny_qwen2_dir, dtype=torch.float32, device="cpu")  # Path and torch.dtype work too
    assert same_tokenizer(lm.tokenizer, other.tokenizer)
    assert lm.tokenizer_fingerprint == tokenizer_fingerprint(other.tokenizer)
    assert lm.fingerprint == model_fingerprint(lm.config, lm.tokenizer) != other.fingerprint
    assert len(lm.fingerprint) == 64


def test_other_tokenizer_differs(tiny_llama_dir, other_tokenizer_model_dir):
    a = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    b = load_model(str(other_tokenizer_model_dir), dtype="fp32", device="cpu")
    assert not same_tokenizer(a.tokenizer, b.tokenizer)


def test_sharded_and_bin_checkpoints(tiny_llama_dir, tmp_path):
    base = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    base.tokenizer.save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(
        _logits(load_model(str(sharded), "fp32", "cpu")), _logits(base), atol=0, rtol=0
    )

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bin_dir / f.name)
    torch.save(hf.state_dict(), bin_dir / "pytorch_model.bin")
    torch.testing.assert_close(
        _logits(load_model(str(bin_dir), "fp32", "cpu")), _logits(base), atol=0, rtol=0
    )


def test_bf16_and_non_native(tiny_qwen3_dir, tiny_gpt2_dir):
    lm = load_model(str(tiny_qwen3_dir), dtype="bf16", device="cpu")
    assert lm.model.info.dtype == torch.bfloat16
    auto = load_model(str(tiny_qwen3_dir), device="cpu")  # default: the measured formats
    plan = auto.model.plan
    assert auto.model.info.format == plan.name and auto.model.info.dtype == plan.act_dtype
    out = _logits(lm)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    g = load_model(str(tiny_gpt2_dir), dtype="bf16", device="cpu")
    assert isinstance(g.model, HFAdapter) and g.model.info.dtype == torch.bfloat16
    assert torch.isfinite(_logits(g)).all()


def test_bad_path_lists_aliases(tmp_path):
    with pytest.raises(SpecDecodeError, match="does not exist") as e:
        load_model(str(tmp_path / "missing"))
    for alias in _aliases() or []:
        assert alias in str(e.value)
    with pytest.raises(SpecDecodeError, match="does not exist"):
        load_model("./no/such/model/dir")
    with pytest.raises(SpecDecodeError, match="no model given"):
        load_model("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_directory_without_weights(tiny_llama_dir, tmp_path):
    d = tmp_path / "noweights"
    d.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    with pytest.raises(SpecDecodeError, match="has no weights"):
        load_model(str(d), "fp32", "cpu")


def test_hub_id_without_network_is_a_clear_error():
    with pytest.raises(SpecDecodeError) as e:
        load_model("specdecode-test-org/no-such-model-anywhere")
    msg = str(e.value)
    assert "could not be found locally or on the Hugging Face hub" in msg
    for alias in _aliases() or []:
        assert alias in msg


def test_bad_dtype(tiny_llama_dir):
    with pytest.raises(SpecDecodeError, match="unknown dtype 'int3'"):
        load_model(str(tiny_llama_dir), dtype="int3")


def test_config_is_read_from_the_directory(tiny_llama_dir):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    lm = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    assert lm.model.info.num_layers == cfg["num_hidden_layers"] and lm.model.info.max_position == 1024


@pytest.mark.slow
def test_alias_loads_smollm2():
    if _aliases() is None:
        pytest.skip("specdecode.assets is not available")
    try:
        lm = load_model("smollm2-135m", dtype="bf16", device="cpu")
    except SpecDecodeError as e:
        pytest.skip(f"smollm2-135m could not be installed: {e}")
    assert lm.name == "smollm2-135m" and isinstance(lm.model, NativeDecoder)
    assert lm.model.info.num_layers == 30 and lm.vocab_size == 49152
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    out = lm.model.prefill(ids, lm.model.new_cache(1, 32), [0])
    assert torch.isfinite(out.logits).all()
