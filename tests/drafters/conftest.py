"""Fixtures for the learned drafters: a tiny fp32 target and data it regenerated itself."""

import json

import pytest

from specdecode.models.loader import load_model
from specdecode.training.regen import regenerate
from specdecode.training.run import run_training
from specdecode.training.trainer import TrainConfig

WORDS = "cat dog park world model tokens sea sky river mountain fox wizard number capital story".split()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory):
    prompts = tmp_path_factory.mktemp("prompts")
    for split, n in (("train", 48), ("heldout", 4)):
        with (prompts / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                a, b = WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)]
                text = f"tell me about the {a} and the {b} {i}"
                f.write(
                    json.dumps({"id": f"{split}/{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
                )
    return prompts


@pytest.fixture(scope="module")
def regen_dir(tiny, prompts_dir, tmp_path_factory):
    prompts = prompts_dir
    out = tmp_path_factory.mktemp("regen")
    regenerate(tiny, prompts, out, max_new_tokens=40, batch_size=16, progress=False)
    return out


def make_cfg(out, steps, **kw) -> TrainConfig:
    base = dict(
        out_dir=str(out),
        steps=steps,
        lr=3e-3,
        warmup_steps=5,
        tokens_per_batch=1024,
        checkpoint_every=10,
        eval_prompts=4,
        eval_max_new_tokens=24,
        log_every=5,
    )
    return TrainConfig(**{**base, **kw})


METHOD_KW = {
    "eagle": {"draft_vocab_size": 128, "ttt_steps": 2},
    "medusa": {"draft_vocab_size": 128, "num_heads": 3},
    "mtp": {"draft_vocab_size": 128, "num_modules": 3},
    "draft": {"draft_vocab_size": 128, "num_layers": 2},
    "dflash": {"draft_vocab_size": 128, "num_layers": 2, "block_size": 4, "num_anchors": 16},
    "dspark": {
        "draft_vocab_size": 128,
        "num_layers": 2,
        "block_size": 4,
        "num_anchors": 16,
        "markov_rank": 32,
    },
}


@pytest.fixture(scope="session")
def train_cfg():
    return make_cfg


@pytest.fixture(scope="session")
def method_kw():
    return METHOD_KW


@pytest.fixture(scope="module")
def trained(tiny, regen_dir, tmp_path_factory):
    """trained(method) -> (checkpoint dir, final summary); each method is trained once per module."""
    done = {}

    def get(method: str):
        if method not in done:
            out = tmp_path_factory.mktemp(method)
            summary = run_training(
                method, tiny, regen_dir, out, make_cfg(out, 80), METHOD_KW[method], progress=False
            )
            done[method] = (out, summary)
        return done[method]

    return get
