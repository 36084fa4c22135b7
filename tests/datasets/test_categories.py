import json
import pydoc_data.topics
import re

import pytest

from specdecode.datasets import categories as D
from specdecode.errors import SpecDecodeError

SIZES = {"chat": 50, "code": 174, "math": 80, "summarization": 40, "rag": 40}


def _user_text(item):
    (message,) = item["messages"]
    assert message["role"] == "user" and message["content"].strip()
    return message["content"]


def test_sizes_are_fixed_and_stated():
    assert D.DATASET_VERSION == "1"
    assert {name: spec.size for name, spec in D.CATEGORIES.items()} == SIZES
    assert [(n, s) for n, s, _ in D.category_table()] == list(SIZES.items())
    for name, size in SIZES.items():
        items = D.load_category(name)
        assert len(items) == size
        assert all(item["category"] == name and item["id"].startswith(name + "/") for item in items)
        assert all(_user_text(item) for item in items)


def test_ids_unique_and_stable_across_calls():
    first = D.load_categories("all")
    ids = [item["id"] for item in first]
    assert len(ids) == len(set(ids)) == sum(SIZES.values())
    first[0]["messages"][0]["content"] = "mutated"  # callers get copies
    second = D.load_categories("all")
    assert [item["id"] for item in second] == ids
    assert D.fingerprint(second) == D.fingerprint(D.load_categories(list(SIZES)))
    assert second[0]["messages"][0]["content"] != "mutated"


def test_sources_and_prompt_forms():
    code = {item["id"]: item for item in D.load_category("code")}
    assert _user_text(code["code/HumanEval_0"]).startswith("Complete this Python function.\n\n```python\n")
    assert _user_text(code["code/HumanEval_0"]).endswith("```")
    assert sum(item["source"].startswith("mt-bench/coding/") for item in code.values()) == 10
    chat = D.load_category("chat")
    groups = {item["source"].split("/")[1] for item in chat}
    assert groups == {"writing", "roleplay", "extraction", "stem", "humanities"}
    assert all(item["second_turn"].strip() for item in chat)
    math_sources = [item["source"].split("/")[0:2] for item in D.load_category("math")]
    assert sum(s == ["mt-bench", "math"] for s in math_sources) == 10
    assert sum(s == ["mt-bench", "reasoning"] for s in math_sources) == 10


def test_limit_is_a_representative_prefix():
    full = D.load_category("code")
    head = D.load_category("code", limit=20)
    assert [i["id"] for i in head] == [i["id"] for i in full[:20]]
    assert any(i["source"].startswith("mt-bench/") for i in head)
    both = D.load_categories("code, math,code", limit=2)
    assert [i["category"] for i in both] == ["code", "code", "math", "math"]


_ANSWERS = {  # written independently of the generator's table
    "shop": lambda boxes, per_box, sold: boxes * per_box - sold,
    "pages": lambda per_day, days, extra: per_day * days + extra,
    "trip": lambda v1, t1, v2, t2: v1 * t1 + v2 * t2,
    "share": lambda friends, each, given: friends * each - given,
    "fence": lambda length, width: 2 * length + 2 * width,
    "boxes": lambda trays, per_tray, per_box: (trays * per_tray) // per_box,
}


def test_generated_math_answers_are_correct():
    generated = [i for i in D.load_category("math") if i["source"].startswith("generated/")]
    assert len(generated) == 60
    for item in generated:
        kind = item["source"].split("/")[1]
        numbers = [int(x) for x in re.findall(r"\d+", _user_text(item))]
        assert isinstance(item["answer"], int) and item["answer"] >= 0
        assert item["answer"] == _ANSWERS[kind](*numbers), item["id"]
    assert len({_user_text(i) for i in generated}) == 60


def _in_pydoc(passage):
    return any(passage in text for text in pydoc_data.topics.topics.values())


def test_summarization_passages_come_from_pydoc_within_bounds():
    for item in D.load_category("summarization"):
        prefix, passage = _user_text(item).split("\n\n", 1)
        assert prefix == D.SUMMARIZE_PREFIX
        assert D.PASSAGE_MIN_CHARS <= len(passage) <= D.PASSAGE_MAX_CHARS
        assert _in_pydoc(passage), item["id"]


def test_rag_contexts_come_from_pydoc_and_hold_the_answer():
    for item in D.load_category("rag"):
        text = _user_text(item)
        assert text.startswith("Context:\n") and "\n\nQuestion: Using the context, explain" in text
        docs = re.findall(r'<document index="\d">\n(.*?)\n</document>', text, flags=re.S)
        assert 2 <= len(docs) <= 3
        assert all(D.PASSAGE_MIN_CHARS <= len(d) <= D.PASSAGE_MAX_CHARS and _in_pydoc(d) for d in docs)
        topic = item["id"].split("/", 1)[1]
        assert sum(pydoc_data.topics.topics[topic].startswith(d) for d in docs) == 1


@pytest.mark.parametrize("limit", [0, -3, 1.5, True])
def test_bad_limit_errors(limit):
    with pytest.raises(SpecDecodeError, match="limit must be an integer >= 1"):
        D.load_category("code", limit=limit)


def test_unknown_or_empty_category_errors(monkeypatch):
    with pytest.raises(SpecDecodeError, match="unknown benchmark category 'translation'.*chat, code, math"):
        D.load_categories("code,translation")
    with pytest.raises(SpecDecodeError, match="no benchmark category given"):
        D.load_categories(" , ")
    empty = D.CategorySpec("empty", 3, "nothing", lambda: [])
    monkeypatch.setitem(D.CATEGORIES, "empty", empty)
    with pytest.raises(SpecDecodeError, match="'empty' is empty"):
        D.load_category("empty")


def test_custom_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"id": "a", "prompt": "Tell me a joke.", "max_new_tokens": 16},
        {"messages": [{"role": "user", "content": "hi"}], "seed": 5, "stop": "\n"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    items = D.load_jsonl_prompts(path)
    assert items == [
        {
            "id": "custom/a",
            "category": "custom",
            "messages": [{"role": "user", "content": "Tell me a joke."}],
            "source": str(path),
            "max_new_tokens": 16,
        },
        {
            "id": "custom/1",
            "category": "custom",
            "messages": [{"role": "user", "content": "hi"}],
            "source": str(path),
            "seed": 5,
            "stop": ["\n"],
        },
    ]
    assert len(D.load_jsonl_prompts(path, limit=1)) == 1
    with pytest.raises(SpecDecodeError, match="does not exist"):
        D.load_jsonl_prompts(tmp_path / "missing.jsonl")


def test_benchmark_texts_cover_every_item():
    texts = D.benchmark_texts()
    items = D.load_categories("all")
    assert all(D.normalize_text(_user_text(item)) in texts for item in items)
    humaneval = next(i for i in items if i["id"] == "code/HumanEval_0")
    raw_prompt = _user_text(humaneval).split("```python\n", 1)[1].removesuffix("```")
    assert D.normalize_text(raw_prompt) in texts
    assert D.normalize_text("  Some  TEXT\n") == "some text"
