"""Tests for specdecode.datasets.prompt_sets: pinned MT-Bench and HumanEval records."""

import pytest

from specdecode.datasets import PROMPT_SETS, load_prompt_set
from specdecode.errors import SpecDecodeError


def test_prompt_sets_are_hash_pinned():
    for prompt_set in PROMPT_SETS.values():
        assert "--hash=sha256:" in prompt_set.requirement


def test_mt_bench_prompts():
    records = load_prompt_set("mt-bench", progress=False)
    assert len(records) == 80
    assert all(len(r["turns"]) == 2 and isinstance(r["turns"][0], str) for r in records)
    categories = {}
    for r in records:
        categories[r["category"]] = categories.get(r["category"], 0) + 1
    assert set(categories.values()) == {10} and len(categories) == 8
    assert len({r["question_id"] for r in records}) == 80


def test_humaneval_prompts():
    records = load_prompt_set("humaneval", progress=False)
    assert len(records) == 164
    assert records[0]["task_id"] == "HumanEval/0"
    assert all({"task_id", "prompt", "entry_point"} <= r.keys() for r in records)


def test_unknown_prompt_set():
    with pytest.raises(SpecDecodeError, match="mt-bench"):
        load_prompt_set("gsm8k")
