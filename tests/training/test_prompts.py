import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.datasets import categories as D
from specdecode.datasets import load_prompt_set
from specdecode.errors import SpecDecodeError
from specdecode.training import prompts as P
from specdecode.training import sources as S

SOURCES = ("code", "docs", "math", "instructions", "chat")
V1_SOURCES = SOURCES[:4]


@pytest.fixture(scope="module")
def default_set():
    return P.build_prompt_set()


@pytest.fixture(scope="module")
def full_set():
    return P.build_prompt_set(num_prompts=P.max_prompts())


def _all(built):
    return built["train"] + built["heldout"]


def _text(record):
    (message,) = record["messages"]
    assert message["role"] == "user" and message["content"].strip()
    return message["content"]


def test_thousands_of_unique_prompts_in_the_fixed_mix(default_set):
    records = _all(default_set)
    assert len(records) == 4000
    assert len({r["id"] for r in records}) == 4000
    assert len({D.normalize_text(_text(r)) for r in records}) == 4000
    counts = {s: sum(r["source"] == s for r in records) for s in SOURCES}
    assert counts == {"code": 1280, "docs": 640, "math": 480, "instructions": 800, "chat": 800}
    for r in records:
        assert set(r) <= {"id", "source", "messages", "answer"} and r["id"].startswith(r["source"] + "/")
        assert ("answer" in r) == (r["source"] == "math")
    for split in ("train", "heldout"):  # every source is on both sides of the split
        assert {r["source"] for r in default_set[split]} == set(SOURCES)
    stats = default_set["stats"]
    assert stats["num_train"] == len(default_set["train"]) and stats["num_heldout"] == len(
        default_set["heldout"]
    )
    assert {s: v["train"] + v["heldout"] for s, v in stats["sources"].items()} == counts
    assert stats["fingerprint"] == P.fingerprint(records)
    # the mix is interleaved: a short prefix already holds every source
    assert {r["source"] for r in default_set["train"][:20]} == set(SOURCES)


def test_every_source_offers_real_variety(full_set):
    templates = {s: {r["id"].split("/")[1] for r in _all(full_set) if r["source"] == s} for s in SOURCES}
    assert {"implement", "implement_class", "explain", "tests"} <= templates["code"]
    assert templates["docs"] == {"summary", "explain", "qa", "key_points"}
    assert len(templates["math"]) == 8 and "compare" in templates["instructions"]
    assert {"email", "story", "role_day", "extract_people", "extract_reviews", "persuade"} <= templates[
        "chat"
    ]
    assert P.max_prompts() >= 5000


def test_no_overlap_with_the_benchmark(full_set):
    records = _all(full_set)
    texts = [D.normalize_text(_text(r)) for r in records]
    assert len(set(texts)) == len({r["id"] for r in records}) == len(records) == P.max_prompts()
    assert not set(texts) & D.benchmark_texts()
    joined = "\n".join(texts)  # normalised texts hold no newline: no match spans two records
    humaneval = [D.normalize_text(r["prompt"]) for r in load_prompt_set("humaneval", progress=False)]
    assert len(humaneval) == 164 and not [p for p in humaneval if p in joined]
    P.check_disjoint(records)
    # pydoc passages: no rag topic at all, and no paragraph that a summarization/rag item shows
    rag_topics = {t for it in D.load_category("rag") for t in re.findall(r"([\w-]+)#\d+", it["source"])}
    shown = {
        D.normalize_text(p)
        for name in ("rag", "summarization")
        for it in D.load_category(name)
        for p in re.split(r"\n\s*\n", _text(it))
    }
    pydoc = [r for r in records if "/pydoc_data." in r["id"]]
    assert pydoc and len(rag_topics) > 30
    for r in pydoc:
        assert r["id"].split("/pydoc_data.")[1].rsplit(".", 1)[0] not in rag_topics
        assert not {D.normalize_text(p) for p in re.split(r"\n\s*\n", _text(r))} & shown


def test_check_disjoint_catches_injected_benchmark_prompts(default_set):
    clean = default_set["train"][:30]
    P.check_disjoint(clean)
    chat = D.load_category("chat", limit=1)[0]
    summary = D.load_category("summarization", limit=1)[0]
    humaneval = load_prompt_set("humaneval", progress=False)[7]["prompt"]
    injected = [
        {"id": "inj/chat", "messages": chat["messages"]},
        {
            "id": "inj/summary",
            "messages": [{"role": "user", "content": "  " + _text(summary).upper() + "\n"}],
        },
        {
            "id": "inj/humaneval",
            "messages": [{"role": "user", "content": f"Finish this:\n{humaneval}\nThanks"}],
        },
    ]
    with pytest.raises(SpecDecodeError) as err:
        P.check_disjoint(clean[:10] + injected + clean[10:])
    message = str(err.value)
    assert "3 training prompt(s)" in message
    assert all(i in message for i in ("inj/chat", "inj/summary", "inj/humaneval"))
    assert not any(r["id"] in message for r in clean)


def test_deterministic_across_calls_and_processes(default_set):
    again = P.build_prompt_set()
    assert again == default_set
    again["train"][0]["messages"][0]["content"] = "mutated"  # callers get copies
    assert P.build_prompt_set()["train"][0]["messages"][0]["content"] != "mutated"
    # Another process (other hash seed, other addresses) builds the same code, math and
    # instruction records; the docs source is built from the same stdlib walk.
    code = (
        "from specdecode.training import prompts as P, sources as S; "
        "print(P.fingerprint(S._code_records() + S._math_records() + S._instruction_records()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = P.fingerprint(S._code_records() + S._math_records() + S._instruction_records())
    assert out.stdout.strip() == here


def test_heldout_split_is_stable_and_disjoint(default_set):
    side = {r["id"]: split for split in ("train", "heldout") for r in default_set[split]}
    assert not {r["id"] for r in default_set["train"]} & {r["id"] for r in default_set["heldout"]}
    assert 0.03 < len(default_set["heldout"]) / 4000 < 0.07
    for kw in ({"num_prompts": 1000}, {"num_prompts": 3000, "seed": 7}, {"num_prompts": 5000}):
        other = P.build_prompt_set(**kw)
        shared = [(r["id"], split) for split in ("train", "heldout") for r in other[split] if r["id"] in side]
        assert len(shared) > 500 and all(side[i] == split for i, split in shared)
    small = P.build_prompt_set(1000)  # same seed: a larger set contains the smaller one
    assert {r["id"] for r in _all(small)} <= set(side)
    half = P.build_prompt_set(1000, heldout_fraction=0.5)
    assert 0.4 < len(half["heldout"]) / 1000 < 0.6
    assert {r["id"] for r in small["heldout"]} <= {r["id"] for r in half["heldout"]}


def test_math_answers_are_correct(full_set):
    solve = {
        "savings": lambda a, b, c: a * b - c,
        "bus": lambda a, b, c, d: a - b + c - d,
        "tiles": lambda a, b, c: a * b * c,
        "discount": lambda price, pct: price * (100 - pct) // 100,
        "sum_range": lambda a, b: sum(range(a, b + 1)),
        "teams": lambda a, b: a % b,
        "change": lambda a, b, paid: paid - a * b,
        "legs": lambda chickens, cows: 2 * chickens + 4 * cows,
    }
    math = [r for r in _all(full_set) if r["source"] == "math"]
    assert len(math) > 800
    for r in math:
        kind, index = r["id"].split("/")[1:]
        numbers = [int(n) for n in re.findall(r"\d+", _text(r))]
        assert isinstance(r["answer"], int) and r["answer"] >= 0
        assert r["answer"] == solve[kind](*numbers), r
        assert _text(r).startswith(S.math_problem(int(index))[1])
    for i in range(S.NUM_MATH):  # the whole generator, not only the problems picked
        kind, question, answer = S.math_problem(i)
        assert answer == solve[kind](*map(int, re.findall(r"\d+", question))) >= 0
    assert S.TRAIN_MATH_SEED != D.MATH_SEED
    assert S.math_problem(11) == S.math_problem(11)


def test_code_tasks_name_real_public_stdlib_objects(full_set):
    code = [r for r in _all(full_set) if r["source"] == "code"]
    for r in code:
        dotted = r["id"].split("/", 2)[2]
        assert not any(part.startswith("_") for part in dotted.split("."))
        assert dotted.split(".")[0] in {m.split(".")[0] for m in S.STDLIB_MODULES}
    implement = {r["id"]: _text(r) for r in code if r["id"].startswith("code/implement/")}
    assert len(implement) > 300
    for rid, text in list(implement.items())[:50]:
        module, name = rid.split("/")[2].rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name))
        assert text.startswith(f"Write a Python function `{name}(") and " at 0x" not in text


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_write_refuse_overwrite(tmp_path):
    out = tmp_path / "set"
    assert P.write_prompt_set(out, num_prompts=200) == out
    built = P.build_prompt_set(200)
    assert _read_jsonl(out / "train.jsonl") == built["train"]
    assert _read_jsonl(out / "heldout.jsonl") == built["heldout"]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["fingerprint"] == built["stats"]["fingerprint"] and set(stats["files_sha256"]) == {
        "train.jsonl",
        "heldout.jsonl",
    }
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "stats.json", "train.jsonl"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    P.write_prompt_set(out, num_prompts=200)  # the same set: left as it is
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(SpecDecodeError, match="overwrite=True"):
        P.write_prompt_set(out, num_prompts=200, seed=1)
    assert _read_jsonl(out / "train.jsonl") == built["train"]
    P.write_prompt_set(out, num_prompts=300, seed=1, overwrite=True)
    assert json.loads((out / "stats.json").read_text())["num_prompts"] == 300
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SpecDecodeError, match="not empty"):
        P.write_prompt_set(other, num_prompts=200)
    with pytest.raises(SpecDecodeError, match="not a directory"):
        P.write_prompt_set(other / "notes.txt", num_prompts=200)


def test_write_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "set"
    P.write_prompt_set(out, num_prompts=100)
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write_text, calls = Path.write_text, []

    def failing_write_text(self, *args, **kwargs):
        calls.append(self.name)
        if len(calls) == 3:  # the third temp file (stats.json) fails: disk full, say
            raise OSError("disk full")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing_write_text)
    with pytest.raises(OSError, match="disk full"):
        P.write_prompt_set(out, num_prompts=150, overwrite=True)
    assert all(name.startswith(".") and ".tmp" in name for name in calls)  # only temp files written
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old  # old set intact, no temp left over


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_prompts": 9}, "from 10 to"),
        ({"num_prompts": 0}, "from 10 to"),
        ({"num_prompts": True}, "from 10 to"),
        ({"num_prompts": 100.0}, "from 10 to"),
        ({"heldout_fraction": 0}, r"\(0, 0.5\]"),
        ({"heldout_fraction": -0.1}, r"\(0, 0.5\]"),
        ({"heldout_fraction": 0.51}, r"\(0, 0.5\]"),
        ({"heldout_fraction": "0.1"}, r"\(0, 0.5\]"),
        ({"seed": "1"}, "seed must be an integer"),
    ],
)
def test_bad_parameters(kw, match):
    with pytest.raises(SpecDecodeError, match=match):
        P.build_prompt_set(**kw)


def test_too_many_prompts_names_the_maximum():
    maximum = P.max_prompts()
    assert len(_all(P.build_prompt_set(maximum))) == maximum
    with pytest.raises(SpecDecodeError, match="maximum the offline sources supply") as err:
        P.build_prompt_set(maximum + 1)
    assert str(maximum) in str(err.value)


def test_quotas_follow_the_shares():
    for n in (10, 11, 99, 1234, 4000):
        quotas = P._quotas(n, P.shares())
        assert sum(quotas.values()) == n
        assert all(abs(quotas[s] - share * n) < 1 for s, share in P.SOURCE_SHARES.items())


def test_a_set_from_some_sources_renormalises_their_shares():
    """The four older sources alone mix as version 1 did (0.4 / 0.2 / 0.15 / 0.25), so a version 1
    set is rebuilt record for record; one source alone is all of the set."""
    assert {s: float(v) for s, v in P.shares(V1_SOURCES).items()} == {
        "code": 0.4,
        "docs": 0.2,
        "math": 0.15,
        "instructions": 0.25,
    }
    assert P._quotas(4000, P.shares(V1_SOURCES)) == {
        "code": 1600,
        "docs": 800,
        "math": 600,
        "instructions": 1000,
    }
    chat = P.build_prompt_set(200, sources=["chat"])
    assert {r["source"] for r in _all(chat)} == {"chat"} and len(_all(chat)) == 200
    assert list(chat["stats"]["sources"]) == ["chat"]
    for bad in (["chat", "chat"], ["novels"], []):
        with pytest.raises(SpecDecodeError, match="sources must be distinct names"):
            P.build_prompt_set(100, sources=bad)
