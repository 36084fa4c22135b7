"""Benchmark prompt categories (Spec-Bench style) built from real offline material; no network.

Contract:
- `CATEGORIES` maps a name to a `CategorySpec` with a stated size; `load_category(name, limit)`
  builds exactly that many items (or raises), always in the same order, so ids and prompts are
  fixed for a given `DATASET_VERSION` (bump it whenever any prompt changes).
    chat           50  MT-Bench turn 1 of writing, roleplay, extraction, stem, humanities
    code          174  HumanEval (164, never executed) + MT-Bench coding (10)
    math           80  MT-Bench math (10) + reasoning (10) + 60 generated arithmetic word problems
    summarization  40  passages of CPython's `pydoc_data.topics` (800-2500 characters)
    rag            40  2-3 `pydoc_data.topics` passages as context + a question about one of them
  There is no translation category: no parallel corpus ships in the installed wheels or the
  CPython stdlib. (The OS's gettext catalogs under /usr/share/locale are bilingual, but they are
  short UI strings whose content depends on the Debian packages installed: not a fixed set.)
- An item is a dict: `id` ("code/HumanEval_0"), `category`, `messages` (one user turn),
  `source` (provenance), and optionally `answer` (int; the generated math problems) and
  `second_turn` (MT-Bench's follow-up question). A multi-turn run appends the model's own first
  answer and then `second_turn`; a fixed placeholder answer would not measure the model.
- `limit` keeps a prefix. Items are interleaved in proportion to their sources, so a prefix is
  a representative sample (a `limit` of 20 on `code` still contains an MT-Bench question).
- `pydoc_data` is CPython's; the two categories built from it depend on the Python minor version
  (named in `category_table()`; `fingerprint(items)` identifies the exact prompts of a run).
  rag uses each topic's opening passage (it starts with the title), summarization later ones.
- `load_jsonl_prompts(path)` reads a user's own file as category "custom" in the same form.
- `benchmark_texts()` is the set of normalised (`normalize_text`) user texts of every item plus
  the raw source texts (HumanEval prompts, MT-Bench turns, pydoc passages), so that training
  prompts can be checked for overlap with the benchmark.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from specdecode.chat import read_prompts_jsonl
from specdecode.datasets.prompt_sets import load_prompt_set
from specdecode.errors import SpecDecodeError

DATASET_VERSION = "1"
MATH_SEED = 1729  # seeds the arithmetic generator; changing it changes prompts: bump the version
NUM_ARITHMETIC = 60
PASSAGE_MIN_CHARS, PASSAGE_MAX_CHARS = 800, 2500
NUM_SUMMARIZATION = 40
NUM_RAG = 40
_MIN_PROSE = 0.75  # share of letters and spaces; keeps table- or grammar-heavy passages out
_PY = f"CPython {sys.version_info.major}.{sys.version_info.minor}"

_CHAT_GROUPS = ("writing", "roleplay", "extraction", "stem", "humanities")
CODE_TEMPLATE = "Complete this Python function.\n\n```python\n{prompt}```"
MATH_SUFFIX = "\nSolve it step by step, then give the final answer as a single integer on the last line."
SUMMARIZE_PREFIX = "Summarize the following passage from the Python documentation in a few sentences."


@dataclass(frozen=True)
class CategorySpec:
    name: str
    size: int  # number of items load_category returns without a limit
    source: str  # where the prompts come from, for the report
    build: Callable[[], list[dict]] = field(repr=False, compare=False)


# ---------------------------------------------------------------------------------------------
# Helpers


def normalize_text(text: str) -> str:
    """Whitespace-collapsed, case-folded text: the key for overlap checks."""
    return " ".join(text.split()).casefold()


def _item(item_id: str, content: str, source: str, **extra) -> dict:
    """One benchmark item; its category is the first part of its id."""
    category = item_id.split("/", 1)[0]
    return dict(
        id=item_id, category=category, messages=[{"role": "user", "content": content}], source=source, **extra
    )


def _interleave(groups: list[list[dict]]) -> list[dict]:
    """Merge groups so that every prefix holds each group in proportion to its size."""
    keyed = [
        (Fraction(2 * j + 1, 2 * len(g)), gi, item) for gi, g in enumerate(groups) for j, item in enumerate(g)
    ]
    return [item for *_, item in sorted(keyed, key=lambda t: t[:2])]


@functools.cache
def _records(prompt_set: str) -> tuple[dict, ...]:
    return tuple(load_prompt_set(prompt_set, progress=False))


def _mt_items(category: str, mt_category: str) -> list[dict]:
    return [
        _item(
            f"{category}/mt_bench_{r['question_id']}",
            r["turns"][0],
            f"mt-bench/{mt_category}/{r['question_id']}",
            second_turn=r["turns"][1],
        )
        for r in _records("mt-bench")
        if r["category"] == mt_category
    ]


# ---------------------------------------------------------------------------------------------
# chat, code


def _build_chat() -> list[dict]:
    return _interleave([_mt_items("chat", g) for g in _CHAT_GROUPS])


def _build_code() -> list[dict]:
    humaneval = [
        _item(
            "code/" + r["task_id"].replace("/", "_"),
            CODE_TEMPLATE.format(prompt=r["prompt"]),
            "humaneval/" + r["task_id"],
        )
        for r in _records("humaneval")
    ]
    return _interleave([humaneval, _mt_items("code", "coding")])


# ---------------------------------------------------------------------------------------------
# math: generated arithmetic word problems. The numbers come from sha256 of (seed, item, name),
# not from `random`, so they are identical on every Python version and platform.

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro")
# kind -> (ranges of the drawn integers, question, answer); ranges keep every answer positive
_PROBLEMS = {
    "shop": (
        {"a": (10, 40), "b": (6, 24), "c": (1, 59)},
        "A shop has {a} boxes with {b} apples in each box. It sells {c} apples. How many apples are left?",
        lambda a, b, c, **_: a * b - c,
    ),
    "pages": (
        {"a": (5, 60), "b": (3, 30), "c": (1, 99)},
        "{who} reads {a} pages every day for {b} days and then {c} more pages. How many pages is that?",
        lambda a, b, c, **_: a * b + c,
    ),
    "trip": (
        {"a": (40, 120), "b": (2, 9), "c": (30, 110), "d": (2, 9)},
        "A train runs at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. "
        "How many kilometres does it travel?",
        lambda a, b, c, d, **_: a * b + c * d,
    ),
    "share": (
        {"a": (3, 12), "b": (8, 40), "c": (1, 23)},
        "{a} friends collect {b} stickers each and then give away {c} stickers in total. "
        "How many stickers do they have left?",
        lambda a, b, c, **_: a * b - c,
    ),
    "fence": (
        {"a": (5, 90), "b": (4, 60)},
        "A rectangular garden is {a} metres long and {b} metres wide. "
        "How many metres of fence go all the way around it?",
        lambda a, b, **_: 2 * (a + b),
    ),
    "boxes": (
        {"a": (3, 15), "b": (6, 24), "c": (4, 12)},
        "A bakery bakes {a} trays of {b} muffins and packs them into boxes of {c}. "
        "How many boxes can it fill completely?",
        lambda a, b, c, **_: a * b // c,
    ),
}


def _draw(index: int, name: str, lo: int, hi: int) -> int:
    digest = hashlib.sha256(f"{MATH_SEED}:{index}:{name}".encode()).digest()
    return lo + int.from_bytes(digest[:8], "little") % (hi - lo + 1)


def _arithmetic(index: int) -> tuple[str, str, int]:
    """(kind, question, integer answer) of the index-th generated problem."""
    kind = list(_PROBLEMS)[index % len(_PROBLEMS)]
    ranges, question, answer = _PROBLEMS[kind]
    values = {k: _draw(index, k, lo, hi) for k, (lo, hi) in ranges.items()}
    values["who"] = _NAMES[_draw(index, "who", 0, len(_NAMES) - 1)]
    return kind, question.format(**values), answer(**values)


def _build_math() -> list[dict]:
    generated = []
    for i in range(NUM_ARITHMETIC):
        kind, question, answer = _arithmetic(i)
        generated.append(
            _item(f"math/arith_{i:02d}", question + MATH_SUFFIX, f"generated/{kind}", answer=answer)
        )
    return _interleave([_mt_items("math", "math"), _mt_items("math", "reasoning"), generated])


# ---------------------------------------------------------------------------------------------
# summarization, rag: passages of CPython's reference topics (sorted keys -> deterministic)


def _paragraph_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every run of non-blank lines, without surrounding whitespace."""
    spans = []
    for m in re.finditer(r"[^\n]*\S[^\n]*(?:\n[^\n]*\S[^\n]*)*", text):
        para = m.group()
        spans.append((m.start() + len(para) - len(para.lstrip()), m.start() + len(para.rstrip())))
    return spans


def _chunks(text: str) -> list[tuple[int, str]]:
    """Greedy runs of whole paragraphs, PASSAGE_MIN_CHARS..PASSAGE_MAX_CHARS long, as
    (start offset, exact substring of `text`); a paragraph longer than the maximum is skipped."""
    out, run = [], []
    for start, end in [*_paragraph_spans(text), (None, None)]:
        if start is not None and end - (run[0][0] if run else start) <= PASSAGE_MAX_CHARS:
            run.append((start, end))
            continue
        if run and run[-1][1] - run[0][0] >= PASSAGE_MIN_CHARS:
            out.append((run[0][0], text[run[0][0] : run[-1][1]]))
        run = [] if start is None or end - start > PASSAGE_MAX_CHARS else [(start, end)]
    return out


@functools.cache
def _passages() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(topic -> its opening passage, which starts with the topic's title;
    topic -> its later passages). Topics whose opening paragraphs fit no passage have none."""
    # Deferred: pydoc_data.topics is a large module, read only when passage categories are built.
    import pydoc_data.topics

    openings, later = {}, {}
    for topic in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[topic]
        chunks = _chunks(text)
        if chunks and chunks[0][0] == len(text) - len(text.lstrip()):
            openings[topic] = chunks.pop(0)[1]
        later[topic] = [c for _, c in chunks]
    return openings, later


def _prose_share(text: str) -> float:
    return sum(ch.isalpha() or ch == " " for ch in text) / len(text)


def _build_summarization() -> list[dict]:
    # Later passages only (the openings serve rag), taken round-robin over the topics so that
    # one long topic does not fill the category.
    _, later = _passages()
    rounds = max((len(v) for v in later.values()), default=0)
    picked = [
        (topic, r, later[topic][r])
        for r in range(rounds)
        for topic in later
        if r < len(later[topic]) and _prose_share(later[topic][r]) >= _MIN_PROSE
    ][:NUM_SUMMARIZATION]
    return [
        _item(
            f"summarization/{topic}_{r + 1}", f"{SUMMARIZE_PREFIX}\n\n{text}", f"pydoc_data/{topic}#{r + 1}"
        )
        for topic, r, text in picked
    ]


def rag_question(title: str) -> str:
    """The question asked about the topic whose opening passage has this title."""
    m = re.fullmatch(r'The "(\w+)" statement', title)
    if m:
        return f"Using the context, explain what the `{m.group(1)}` statement does and give one example."
    return f"Using the context, explain what the section '{title}' covers and give one example."


def _build_rag() -> list[dict]:
    # Every item: its target topic's opening passage plus 1 or 2 openings of other topics at
    # fixed offsets in the pool; the target's position rotates so it is not always first.
    openings, _ = _passages()
    pool = list(openings)
    items = []
    for i, topic in enumerate(pool[:NUM_RAG]):
        others = [pool[(i + off) % len(pool)] for off in (17, 31)][: 1 + i % 2]
        topics = others[:]
        topics.insert(i % (len(others) + 1), topic)
        docs = "\n".join(
            f'<document index="{k + 1}">\n{openings[t]}\n</document>' for k, t in enumerate(topics)
        )
        title = openings[topic].splitlines()[0].strip()
        items.append(
            _item(
                f"rag/{topic}",
                f"Context:\n{docs}\n\nQuestion: {rag_question(title)}",
                f"pydoc_data/{topic}#0 + " + ", ".join(f"{t}#0" for t in others),
            )
        )
    return items


# ---------------------------------------------------------------------------------------------
# Public API

_MATH_SOURCE = f"MT-Bench math (10) + reasoning (10) + {NUM_ARITHMETIC} generated (seed {MATH_SEED})"
_PASSAGES_SOURCE = f"{_PY} pydoc_data.topics, {PASSAGE_MIN_CHARS}-{PASSAGE_MAX_CHARS} char passages"
CATEGORIES: dict[str, CategorySpec] = {
    s.name: s
    for s in (
        CategorySpec(
            "chat", 50, "MT-Bench turn 1 (writing, roleplay, extraction, stem, humanities)", _build_chat
        ),
        CategorySpec("code", 174, "HumanEval (164) + MT-Bench coding (10)", _build_code),
        CategorySpec("math", 80, _MATH_SOURCE, _build_math),
        CategorySpec("summarization", NUM_SUMMARIZATION, _PASSAGES_SOURCE, _build_summarization),
        CategorySpec("rag", NUM_RAG, _PASSAGES_SOURCE + ", 2-3 per question", _build_rag),
    )
}


def _check_limit(limit) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise SpecDecodeError(f"limit must be an integer >= 1 (or None for all items), got {limit!r}")


@functools.cache
def _built(name: str) -> tuple[dict, ...]:
    spec = CATEGORIES[name]
    items = spec.build()
    if not items:
        raise SpecDecodeError(f"benchmark category {name!r} is empty: {spec.source} gave no items")
    if len(items) != spec.size:
        raise SpecDecodeError(
            f"benchmark category {name!r} has {len(items)} items instead of {spec.size}: its source "
            f"({spec.source}) is not the one dataset version {DATASET_VERSION} was built from"
        )
    return tuple(items)


def load_category(name: str, limit: int | None = None) -> list[dict]:
    """The first `limit` items (all when None) of a category, as fresh dicts."""
    _check_limit(limit)
    if name not in CATEGORIES:
        raise SpecDecodeError(
            f"unknown benchmark category {name!r}; valid categories: {', '.join(CATEGORIES)} (or 'all'). "
            "For your own prompts pass a JSONL file."
        )
    return copy.deepcopy(list(_built(name)[:limit]))


def parse_category_names(names: Iterable[str] | str) -> list[str]:
    """'all', 'code,math' or a list of such strings -> category names, in order, without repeats."""
    parts = [names] if isinstance(names, str) else list(names)
    out = []
    for part in parts:
        for name in (p.strip() for p in part.split(",")):
            expanded = list(CATEGORIES) if name == "all" else [name]
            out += [n for n in expanded if n and n not in out]
    if not out:
        raise SpecDecodeError(f"no benchmark category given; valid: {', '.join(CATEGORIES)} or 'all'")
    return out


def load_categories(names: Iterable[str] | str, limit: int | None = None) -> list[dict]:
    """Items of several categories, category by category; `limit` applies to each category."""
    _check_limit(limit)
    return [item for name in parse_category_names(names) for item in load_category(name, limit)]


def load_jsonl_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """A user's prompts file (see `specdecode.chat`) as items of category "custom". A plain
    `prompt` becomes a single user message; `seed`, `max_new_tokens` and `stop` are kept."""
    _check_limit(limit)
    items = []
    for p in read_prompts_jsonl(path)[:limit]:
        messages = p.messages if p.messages is not None else [{"role": "user", "content": p.prompt}]
        item = {"id": f"custom/{p.id}", "category": "custom", "messages": messages, "source": str(path)}
        for key in ("seed", "max_new_tokens"):
            if getattr(p, key) is not None:
                item[key] = getattr(p, key)
        if p.stop:
            item["stop"] = list(p.stop)
        items.append(item)
    return items


def category_table() -> list[tuple[str, int, str]]:
    """(name, size, source) of every category, for the report."""
    return [(s.name, s.size, s.source) for s in CATEGORIES.values()]


def fingerprint(items: list[dict]) -> str:
    """Short sha256 of the items' ids and messages: identifies the exact prompts of a run."""
    blob = json.dumps([[it["id"], it["messages"]] for it in items], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def benchmark_texts() -> set[str]:
    """Normalised user texts of every benchmark item, plus the raw sources (HumanEval prompts,
    all MT-Bench turns, every pydoc passage this module cuts, used or not). Training prompts
    must not equal, and should not contain, any of them."""
    texts = set()
    for name in CATEGORIES:
        texts.update(m["content"] for item in _built(name) for m in item["messages"] if m["role"] == "user")
    texts.update(r["prompt"] for r in _records("humaneval"))
    texts.update(t for r in _records("mt-bench") for t in r["turns"])
    openings, later = _passages()
    texts.update(openings.values())
    texts.update(t for v in later.values() for t in v)
    return {normalize_text(t) for t in texts}
