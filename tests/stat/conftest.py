"""Fixtures for the loop-level distribution tests: a peaked tiny target, a noisy copy of it as a
draft model, the target in transformers (for exact laws), and the prompt they decode.

All are built once per session from `make_tiny_model` (tests/conftest.py), seeded, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from loop_stats import write_peaked

from specdecode.models.loader import load_model

SUPPORT_TOKENS = ("a", "b", "c", "d")  # the target puts ~98 % of its mass on these (measured)
PROMPT = "a b a a c a a a d a a b a a"  # letters, read as SUPPORT_TOKENS ids (repeats feed n-grams)


@dataclass
class Peaked:
    target: object  # LoadedModel (native, fp32)
    draft: object  # LoadedModel: the target plus noise on every layer matrix, logits x 1.5
    reference: object  # transformers model of the target (exact laws)
    support: list[int]  # token ids
    prompt: list[int]


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: a distribution test over ~10 s (deselect with -m 'not heavy')")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine two threads
    per process slow these tests down tenfold (measured); restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def peaked(make_tiny_model, tmp_path_factory) -> Peaked:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_tiny_model("qwen2", name="stat_base", seed=7)
    tok = AutoTokenizer.from_pretrained(base)
    support = [tok.convert_tokens_to_ids(t) for t in SUPPORT_TOKENS]
    assert tok.unk_token_id not in support
    target_dir = write_peaked(base, tmp_path_factory.mktemp("stat_target"), support)
    draft_dir = write_peaked(
        base, tmp_path_factory.mktemp("stat_draft"), support, noise=0.15, sharpen=1.5, seed=1
    )
    prompt = [support[SUPPORT_TOKENS.index(c)] for c in PROMPT.split()]
    return Peaked(
        target=load_model(str(target_dir), dtype="fp32", device="cpu"),
        draft=load_model(str(draft_dir), dtype="fp32", device="cpu"),
        reference=AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval(),
        support=support,
        prompt=prompt,
    )
