"""MTP native mode: the target and the modules train jointly (L_main + 0.3 L_MTP); the new target
is written as a Hugging Face directory, serves the drafter losslessly, and its quality is
measured against the original (response NLL)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.mtp import load_mtp
from specdecode.models.loader import load_model
from specdecode.policy import FixedK
from specdecode.training.data import load_sequences
from specdecode.training.methods.mtp import response_nll
from specdecode.training.run import run_training


@pytest.fixture(scope="module")
def native(tiny, regen_dir, tmp_path_factory, train_cfg, method_kw):
    out = tmp_path_factory.mktemp("mtp-native")
    kw = {**method_kw["mtp"], "mode": "native", "mtp_weight": 0.3, "trunk_lr_scale": 0.1}
    # Killed after 10 steps, then resumed: the run must finish from its checkpoint.
    first = run_training("mtp", tiny, regen_dir, out, train_cfg(out, 40, stop_at=10), kw, progress=False)
    assert first["stopped_at"] == 10 and (out / "target" / "config.json").exists()
    last = run_training("mtp", tiny, regen_dir, out, train_cfg(out, 40), kw, progress=False)
    return out, last


def test_native_training_updates_the_target_and_trains_the_modules(tiny, native):
    out, last = native
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "main_nll" in r]
    numbers = [r["step"] for r in steps]
    assert numbers == list(range(5, 41, 5))  # resumed at 10, not restarted (a restart logs 5, 10 twice)
    assert steps[-1]["loss_1"] < steps[0]["loss_1"]  # the modules learn
    assert all(f"loss_{k}" in steps[-1] for k in (1, 2, 3))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method"] == "mtp" and cfg["training"]["mode"] == "native"
    assert cfg["training"]["mtp_weight"] == 0.3
    new = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32)
    diffs = [
        float((a - b).abs().max())
        for a, b in zip(new.state_dict().values(), old.state_dict().values(), strict=True)
    ]
    assert max(diffs) > 1e-4  # the trunk moved
    assert last["eval_tau"] > 1.3  # served by the jointly trained target


def test_native_target_serves_the_drafter_losslessly(tiny, native, regen_dir):
    out, _ = native
    new = load_model(str(out / "target"), dtype="fp32", device="cpu")
    assert new.fingerprint == tiny.fingerprint  # same architecture and tokenizer
    drafter = load_mtp(out, new)
    prompts = [new.tokenizer(t)["input_ids"] for t in ("the cat sat on the mat", "tell me about the sea")]

    def run(d, k):
        dec = SpeculativeDecoder(new, d, FixedK(k), max_batch=4)
        reqs = [
            GenerationRequest(p, SamplingParams(), 32, id=str(i), ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        return dec.generate(reqs)

    base, spec = run(ARDrafter(), 0), run(drafter, 3)
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    assert sum(s.tau for s in spec) / len(spec) > 1.2


def test_response_nll_compares_targets(tiny, native, regen_dir):
    out, _ = native
    seqs = load_sequences(regen_dir, "heldout", 512, tiny.fingerprint)
    old = AutoModelForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
    a, b = response_nll(old, seqs), response_nll(new, seqs)
    assert 0 < a < 20 and 0 < b < 20 and a != b
    # Batching does not change the value (padding is masked).
    assert response_nll(old, seqs, tokens_per_batch=64) == pytest.approx(a, rel=1e-4)


def test_cli_mode_applies_to_mtp_only(capsys, tiny_llama_dir, regen_dir, tmp_path):
    from specdecode.cli import main

    args = [
        "train",
        "eagle",
        "--target",
        str(tiny_llama_dir),
        "--data",
        str(regen_dir),
        "--out",
        str(tmp_path),
    ]
    assert main([*args, "--mode", "native"]) == 2
    assert "--mode native applies to mtp only" in capsys.readouterr().err
