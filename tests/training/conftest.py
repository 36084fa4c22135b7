"""Fixtures for the trainer tests: small regenerated data sets of the tiny fp32 llama."""

import json

import pytest

from specdecode.models.loader import load_model
from specdecode.training.regen import regenerate


@pytest.fixture(scope="module")
def make_regen(tiny_llama_dir, tmp_path_factory):
    """make_regen(name, n, text) -> (target, regen dir): the tiny target's answers (24 tokens) to n
    training prompts `text.format(i)`."""

    def make(name: str, n: int, text: str):
        prompts = tmp_path_factory.mktemp(f"{name}_prompts")
        with (prompts / "train.jsonl").open("w") as f:
            for i in range(n):
                msg = [{"role": "user", "content": text.format(i)}]
                f.write(json.dumps({"id": f"t{i}", "messages": msg}) + "\n")
        out = tmp_path_factory.mktemp(f"{name}_regen")
        target = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
        regenerate(
            target, prompts, out, splits=("train",), max_new_tokens=24, batch_size=n // 2, progress=False
        )
        return target, out

    return make
