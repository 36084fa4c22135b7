import json

import pytest

from specdecode.chat import derive_seed, read_prompts_jsonl
from specdecode.errors import SpecDecodeError


def _write(tmp_path, lines):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_reads_prompts_and_messages(tmp_path):
    p = _write(
        tmp_path,
        [
            json.dumps({"id": "a", "prompt": "hello"}),
            "",
            json.dumps({"id": 7, "messages": [{"role": "user", "content": "hi"}], "seed": 3}),
        ],
    )
    items = read_prompts_jsonl(p)
    assert [i.id for i in items] == ["a", "7"]
    assert items[0].prompt == "hello" and items[1].messages[0]["content"] == "hi" and items[1].seed == 3


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", r"p.jsonl:2: not valid JSON"),
        (json.dumps({"prompt": ""}), r"p.jsonl:2: 'prompt' must be a non-empty string"),
        (json.dumps({"prompt": "x", "messages": []}), r"p.jsonl:2: give exactly one"),
        (json.dumps({"messages": [{"role": "user"}]}), r"p.jsonl:2: messages\[0\]"),
        (json.dumps({"prompt": "x", "seed": -1}), r"p.jsonl:2: 'seed'"),
        (json.dumps([1, 2]), r"p.jsonl:2: expected a JSON object"),
        (json.dumps({"id": "a", "prompt": "dup"}), r"p.jsonl:2: duplicate id"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path, line, match):
    p = _write(tmp_path, [json.dumps({"id": "a", "prompt": "ok"}), line])
    with pytest.raises(SpecDecodeError, match=match):
        read_prompts_jsonl(p)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(SpecDecodeError, match="does not exist"):
        read_prompts_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(SpecDecodeError, match="no prompts"):
        read_prompts_jsonl(_write(tmp_path, [""]))


def test_derived_seeds_are_distinct_and_reproducible():
    seeds = [derive_seed(0, i) for i in range(100)]
    assert len(set(seeds)) == 100
    assert seeds == [derive_seed(0, i) for i in range(100)]
    assert derive_seed(1, 0) != derive_seed(0, 0)
