"""The drafters shipped for SmolLM2-135M load by default, fit the size limit, and stay exact."""

import json

import pytest

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters import DEFAULT_NUM_DRAFT, build_drafter
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.checkpoint import SHIPPED_ROOT
from specdecode.models.loader import load_model
from specdecode.policy import FixedK

SHIPPED = sorted(d for d in SHIPPED_ROOT.iterdir() if (d / "config.json").is_file())


def test_shipped_drafters_have_cards_and_fit_the_limit():
    methods = {json.loads((d / "config.json").read_text())["method"] for d in SHIPPED}
    assert {"eagle", "medusa", "mtp", "draft", "dflash", "dspark", "ngram-table"} <= methods
    total = sum((d / "model.safetensors").stat().st_size for d in SHIPPED)
    assert total < 80e6  # every drafter shipped for every target, together
    for d in SHIPPED:
        if json.loads((d / "config.json").read_text())["method"] != "ngram-table":
            assert json.loads((d / "config.json").read_text()).get("storage") == "int8"
        card = (d / "README.md").read_text()
        assert "Served tau" in card and "Training:" in card


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(str(smollm2_dir), dtype="fp32", device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        "eagle",
        "eagle-tree",
        "eagle-tree-lookup",
        "medusa",
        "mtp",
        "draft",
        "dflash",
        "dflash-tree-lookup",
        "dspark",
        "dspark-tree",
        "dspark-tree-lookup",
        "ngram-table",
        "ngram-table-tree",
    ],
)
def test_shipped_drafter_is_the_default_and_greedy_exact(smollm2, method):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]

    def run(drafter, k):
        dec = SpeculativeDecoder(smollm2, drafter, FixedK(k), max_batch=1)
        return dec.generate([GenerationRequest(prompt, SamplingParams(), 24, ignore_eos=True)])[0]

    base = run(ARDrafter(), 0)
    spec = run(build_drafter(method, smollm2), DEFAULT_NUM_DRAFT[method])
    assert spec.token_ids == base.token_ids
    assert spec.tau > 1.0  # the shipped weights really draft accepted tokens
