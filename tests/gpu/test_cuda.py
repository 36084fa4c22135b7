"""CUDA: the loop is lossless on a GPU too (run by scripts/device_check.sh on a lent GPU; skipped
elsewhere). Greedy speculative == greedy ar token for token in fp32, batch == single at T = 1,
and the native runtime's logits on CUDA match the CPU's."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.models.loader import load_model
from specdecode.policy import FixedK
from specdecode.training.run import run_training
from specdecode.training.trainer import TrainConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TEXTS = ["the cat sat on the mat and the cat", "hello world, hello", "a b c d e f g a b c"]


def _run(target, drafter, k, params, max_batch=3, seeds=(0, 1, 2)):
    dec = SpeculativeDecoder(target, drafter, FixedK(k), max_batch=max_batch)
    tok = target.tokenizer
    reqs = [
        GenerationRequest(tok(t)["input_ids"], params, 24, seed=s, id=str(i), ignore_eos=True)
        for i, (t, s) in enumerate(zip(TEXTS, seeds, strict=True))
    ]
    return [r.token_ids for r in dec.generate(reqs)]


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tiny_qwen2_dir):
    return (
        load_model(str(tiny_llama_dir), dtype="fp32", device="cuda"),
        load_model(str(tiny_qwen2_dir), dtype="fp32", device="cuda"),
    )


def test_greedy_spec_equals_ar_on_cuda(pair):
    target, other = pair
    base = _run(target, ARDrafter(), 0, SamplingParams())
    v, rows = target.vocab_size, target.model.info.vocab_size
    for drafter in (
        NgramDrafter(),
        DraftModelDrafter(other.model, v, rows),
        DraftModelDrafter(target.model, v, rows),
    ):
        assert _run(target, drafter, 4, SamplingParams()) == base


def test_sampled_batch_equals_single_on_cuda(pair):
    target, other = pair
    v, rows = target.vocab_size, target.model.info.vocab_size
    params = SamplingParams(temperature=1.0, top_p=0.9)
    batched = _run(target, DraftModelDrafter(other.model, v, rows), 3, params)
    singles = [
        _run_one(target, DraftModelDrafter(other.model, v, rows), params, i) for i in range(len(TEXTS))
    ]
    assert batched == singles


def _run_one(target, drafter, params, i):
    dec = SpeculativeDecoder(target, drafter, FixedK(3), max_batch=1)
    ids = target.tokenizer(TEXTS[i])["input_ids"]
    return dec.generate([GenerationRequest(ids, params, 24, seed=i, id="x", ignore_eos=True)])[0].token_ids


def test_native_logits_match_cpu(tiny_qwen3_dir):
    cpu = load_model(str(tiny_qwen3_dir), dtype="fp32", device="cpu").model
    gpu = load_model(str(tiny_qwen3_dir), dtype="fp32", device="cuda").model
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    a = cpu.forward(ids, None, cpu.new_cache(2, 16), [0, 1]).logits
    b = gpu.forward(ids.cuda(), None, gpu.new_cache(2, 16), [0, 1]).logits.cpu()
    assert (a - b).abs().max() < 1e-3 * a.abs().max()
    auto = load_model(str(tiny_qwen3_dir), dtype="auto", device="cuda").model
    assert auto.info.dtype == torch.bfloat16  # auto on CUDA: bf16


def regen_and_train(make_regen, tmp_path, device: str) -> list[dict]:
    """Regenerate a few answers with the tiny target on `device`, then train DSpark and EAGLE-3
    side by side there for 3 steps (bf16 autocast, as scripts/device_train.sh does)."""
    target, regen = make_regen(f"regen_{device}", 8, "count to {}", device=device)
    cfg = TrainConfig(
        out_dir=str(tmp_path / "train"),
        steps=3,
        warmup_steps=1,
        tokens_per_batch=128,
        eval_prompts=0,
        bf16=True,
    )
    kw = {"dspark": {"draft_vocab_size": 128, "markov_rank": 8}, "eagle": {"draft_vocab_size": 128}}
    return run_training("dspark,eagle", target, regen, tmp_path / "train", cfg, kw, progress=False)


def test_regeneration_and_training_run_on_cuda(make_regen, tmp_path):
    results = regen_and_train(make_regen, tmp_path, "cuda")
    for m, res in zip(("dspark", "eagle"), results, strict=True):
        losses = [v for k, v in res.items() if k.startswith("loss")]
        assert res["step"] == 3 and losses and all(map(math.isfinite, losses)), (m, res)
        assert (tmp_path / "train" / m / "model.safetensors").exists()
