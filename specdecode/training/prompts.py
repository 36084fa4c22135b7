"""Training prompt set for drafters: real offline sources, disjoint from every benchmark prompt.

Contract:
- Four deterministic offline sources (no network, no model), mixed in fixed `SOURCE_SHARES`:
    code          implement / explain / write-tests tasks over the public functions, classes and
                  methods with a docstring of `STDLIB_MODULES` (walked with `inspect`)
    docs          summary / explanation / QA / key points over stdlib docstrings and passages of
                  `pydoc_data.topics`: none from a topic the benchmark's rag items use, none with a
                  paragraph a summarization or rag item shows, cut to another length (250-1500)
    math          generated integer word problems (own templates and `TRAIN_MATH_SEED`); + `answer`
    instructions  writing / explaining / comparing templates over `PROGRAMMING_TOPICS`, `SCIENCE_TOPICS`
- A record: `{"id": "<source>/<template>/<subject>", "source", "messages": [one user turn]}`
  (+ `"answer"`: int, math only). Ids are unique, and so are user texts after `normalize_text`.
- `build_prompt_set(num_prompts, heldout_fraction, seed)` takes each source's quota (largest
  remainder) from its pool in sha256(seed, id) order, so a larger set with the same seed contains
  a smaller one, and interleaves the sources so that every prefix holds them in proportion. A
  record is held out when the hash of its normalised text is below `heldout_fraction`: it is on
  the same side in every set, whatever num_prompts or seed (a tiny set may hold out nothing).
- `check_disjoint(records)` raises if a user text equals a `benchmark_texts()` entry or contains a
  HumanEval prompt. The pools are filtered with the same test and every built set is checked.
- `write_prompt_set(out_dir, ...)` writes train.jsonl, heldout.jsonl and stats.json as temp files,
  then renames them (stats.json last; it holds both files' sha256). An identical set already there
  is left as it is; any other non-empty directory is refused unless `overwrite=True`.
- Docstrings and pydoc topics depend on the CPython minor version: stats name it, and their
  `fingerprint` identifies the exact prompts (of train, then heldout).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import os
import re
import sys
import warnings
from fractions import Fraction
from pathlib import Path

from specdecode.bench.datasets import DATASET_VERSION, benchmark_texts, load_category, normalize_text
from specdecode.errors import SpecDecodeError

PROMPT_SET_VERSION = "1"  # bump whenever any prompt changes
SOURCE_SHARES = {"code": 0.40, "docs": 0.20, "math": 0.15, "instructions": 0.25}
MIN_PROMPTS = 10
TRAIN_MATH_SEED = 90210  # the benchmark's arithmetic uses another seed (1729)
NUM_MATH = 2000  # generated problems in the math pool, before deduplication
PASSAGE_MIN_CHARS, PASSAGE_MAX_CHARS = 250, 1500  # the benchmark's passages are 800-2500

STDLIB_MODULES = """
abc argparse array ast base64 bisect bz2 calendar cmath codecs collections colorsys
concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib
email.message email.utils enum filecmp fnmatch fractions functools getopt gettext glob graphlib
gzip hashlib heapq hmac html html.parser http.client http.cookies inspect io ipaddress itertools
json keyword linecache locale logging lzma math mimetypes numbers operator os os.path pathlib
pickle platform plistlib pprint queue quopri random re reprlib sched secrets selectors shelve
shlex shutil socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap
threading time timeit tokenize traceback types typing unicodedata unittest urllib.parse
urllib.request uuid warnings wave weakref xml.etree.ElementTree zipfile zlib
""".split()


def _groups(text: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(t.strip() for t in line.split(";")) for line in text.strip().splitlines())


# One group of related topics a line; "compare" prompts pair topics within a group.
PROGRAMMING_TOPICS = _groups("""
linked lists; hash tables; binary search trees; heaps; tries; graphs
binary search; quicksort; merge sort; dynamic programming; breadth-first search; Dijkstra's algorithm
list comprehensions; generators; decorators; context managers; descriptors; metaclasses
threads; processes; async/await; locks; deadlocks; message queues
unit testing; code review; continuous integration; refactoring; semantic versioning; technical debt
virtual memory; file systems; TCP; DNS; HTTP caching; TLS
SQL joins; database indexes; transactions; database normalization; document databases; query planning
git branches; debuggers; profilers; linters; package managers; containers
object-oriented programming; functional programming; recursion; immutability; static typing; design patterns
gradient descent; overfitting; neural networks; decision trees; cross-validation; attention in transformers
""")
SCIENCE_TOPICS = _groups("""
Newton's laws of motion; conservation of energy; electromagnetism; special relativity; entropy; optics
chemical bonding; acids and bases; redox reactions; catalysts; chemical equilibrium; the periodic table
photosynthesis; cellular respiration; DNA replication; natural selection; the immune system; enzymes
plate tectonics; the water cycle; erosion; volcanoes; earthquakes; ocean currents
black holes; the life cycle of stars; exoplanets; the Big Bang; tides; the seasons
the greenhouse effect; ocean acidification; biodiversity; renewable energy; the carbon cycle; food webs
prime numbers; probability; derivatives; linear algebra; the normal distribution; proof by induction
the circulatory system; the nervous system; digestion; vaccines; sleep; antibiotic resistance
semiconductors; superconductivity; batteries; lasers; bridge design; 3D printing
the scientific method; germ theory; the Copernican revolution; the structure of DNA; peer review; penicillin
""")

_TOPIC_TEMPLATES = {
    "explain": "Explain {t} to a beginner, using a simple example.",
    "blog": "Write a short blog post (about 300 words) about {t}.",
    "misconceptions": "What are common misconceptions about {t}? Correct each one.",
    "quiz": "Write three quiz questions about {t}, each with its answer and a one-sentence explanation.",
    "bullets": "Summarize the key ideas of {t} in five bullet points.",
    "analogy": "Give an analogy that makes {t} easy to understand, then say where the analogy breaks down.",
    "lesson": "Write a plan for a one-hour lesson on {t} for high-school students.",
    "paragraphs": "Explain {t} in three paragraphs: what it is, why it matters, and one concrete example.",
}
_DOMAIN_TEMPLATES = {
    "programming": {
        "demo": "Write a short Python program that demonstrates {t}, with comments explaining each step.",
        "mistakes": "What mistakes do developers often make with {t}, and how can they be avoided?",
        "interview": "Write an interview question about {t} and a model answer.",
    },
    "science": {
        "experiment": "Describe a simple experiment or observation that demonstrates {t}.",
        "everyday": "How does {t} show up in everyday life? Give three examples.",
        "dialogue": "Write a short dialogue in which a student asks a scientist about {t}.",
    },
}
_COMPARE = "Compare {a} and {b}: how are they alike, how do they differ, and when does each matter?"
_CODE_TEMPLATES = {
    "implement": "Write a Python function `{name}{sig}` that does the following:\n\n{summary}\n\n"
    "Include a docstring and handle edge cases.",
    "implement_class": "Write a simplified Python class `{name}` that does the following:\n\n{summary}\n\n"
    "Implement its most important methods and show a short usage example.",
    "explain": "Explain what `{dotted}` from the Python standard library does and show a usage example.",
    "tests": "Write pytest unit tests for `{dotted}`, which the documentation describes as follows:\n\n"
    "{summary}\n\nCover typical use and edge cases.",
}
_DOC_TEMPLATES = {
    "summary": "Summarize the following documentation of {title} in a few sentences.\n\n{text}",
    "explain": "Explain this passage about {title} in plain language for someone new to Python, "
    "with one short example.\n\n{text}",
    "qa": "Read the documentation below and answer the question.\n\n{text}\n\nQuestion: {question}",
    "key_points": "List the key points of this documentation of {title} as 3-5 bullet points.\n\n{text}",
}
_MATH_SUFFIXES = (
    "\nShow your working, then give the final answer as an integer.",
    "\nExplain each step and end with 'Answer: <integer>'.",
    "\nThink it through step by step and finish with the integer answer on its own line.",
)
_NAMES = ("Amara", "Bruno", "Carmen", "Dmitri", "Esme", "Felix", "Greta", "Hassan", "Ines", "Jonas")
# kind -> (question, answer). `{a:5-50}` draws an integer a in [5, 50]; the ranges keep every answer
# >= 0, and "{a:2-40}0" writes ten times a, so that prices and percentages stay round.
_MATH_KINDS = {
    "savings": (
        "{who} saves {a:5-50} dollars every week for {b:4-20} weeks and then spends {c:1-19} dollars "
        "on a gift. How many dollars does {who} have left?",
        lambda a, b, c: a * b - c,
    ),
    "bus": (
        "A bus leaves the depot with {a:40-80} passengers. At the first stop {b:1-19} people get off and "
        "{c:1-30} get on. At the second stop {d:1-20} get off. How many passengers are on the bus now?",
        lambda a, b, c, d: a - b + c - d,
    ),
    "tiles": (
        "A room is {a:3-15} metres long and {b:3-15} metres wide. Flooring costs {c:8-45} dollars per "
        "square metre. How many dollars does it cost to cover the floor?",
        lambda a, b, c: a * b * c,
    ),
    "discount": (
        "A jacket costs {a:2-40}0 dollars and is sold at {b:1-5}0 percent off. What is the sale price "
        "in dollars?",
        lambda a, b: a * (10 - b),
    ),
    "sum_range": (
        "What is the sum of all whole numbers from {a:1-50} to {b:60-150}, inclusive?",
        lambda a, b: (b - a + 1) * (a + b) // 2,
    ),
    "teams": (
        "{a:30-200} students are split into teams of {b:3-9}. How many students are left over after "
        "forming as many full teams as possible?",
        lambda a, b: a % b,
    ),
    "change": (
        "{who} buys {a:2-6} notebooks at {b:2-9} dollars each and pays with {c:6-10}0 dollars. How many "
        "dollars of change does {who} get?",
        lambda a, b, c: 10 * c - a * b,
    ),
    "legs": (
        "A farm has {a:3-60} chickens and {b:2-40} cows. How many legs do these animals have in total?",
        lambda a, b: 2 * a + 4 * b,
    ),
}


# ---------------------------------------------------------------------------------------------
# Helpers


def _record(source: str, template: str, subject: str, content: str, **extra) -> dict:
    messages = [{"role": "user", "content": content}]
    return dict(id=f"{source}/{template}/{subject}", source=source, messages=messages, **extra)


def _hash64(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def _user_texts(record: dict) -> list[str]:
    return [m["content"] for m in record["messages"] if m.get("role") == "user"]


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _trim(text: str) -> str:
    """The leading whole paragraphs of `text` that fit in PASSAGE_MAX_CHARS (may be empty)."""
    out = ""
    for para in _paragraphs(text):
        if len(out) + len(para) + 2 > PASSAGE_MAX_CHARS:
            break
        out = f"{out}\n\n{para}" if out else para
    return out


# ---------------------------------------------------------------------------------------------
# Sources: each returns its records in a fixed order; `_pools` filters and deduplicates them.


@functools.cache
def _stdlib_api() -> tuple[tuple[str, str, object], ...]:
    """(kind, dotted name, object): public functions, classes and their methods with a docstring
    of their own, defined in the module itself (not re-exported, not from submodules), in
    module-list then name order; each object once, under the first module that offers it."""
    seen, out = set(), []
    with warnings.catch_warnings():  # some public names are deprecated aliases
        warnings.simplefilter("ignore")
        for mod_name in STDLIB_MODULES:
            module = importlib.import_module(mod_name)
            names = getattr(module, "__all__", None) or vars(module)
            for name in sorted(n for n in set(names) if not n.startswith("_")):
                obj = getattr(module, name, None)  # getattr: names some modules load lazily
                is_func = inspect.isfunction(obj) or inspect.isbuiltin(obj)
                if not (is_func or inspect.isclass(obj)) or id(obj) in seen or not obj.__doc__:
                    continue
                home, where = module.__name__.lstrip("_"), str(getattr(obj, "__module__", "")).lstrip("_")
                # Defined in this very module: objects of submodules show up in vars(module) only
                # once something imports that submodule, which would make the set depend on
                # what the process happened to import before.
                if where != home:
                    continue
                seen.add(id(obj))
                out.append(("function" if is_func else "class", f"{mod_name}.{name}", obj))
                for m_name, member in sorted(vars(obj).items()) if not is_func else ():
                    if m_name.startswith("_") or id(member) in seen:
                        continue
                    # Methods other libraries patch onto stdlib classes (transformers adds
                    # logging.Logger.warning_once) are not the stdlib's: skip them.
                    patched = str(getattr(member, "__module__", None) or where).lstrip("_") != where
                    if patched:
                        continue
                    if inspect.ismethoddescriptor(member) or inspect.isfunction(member):
                        if isinstance(getattr(member, "__doc__", None), str):
                            seen.add(id(member))
                            out.append(("method", f"{mod_name}.{name}.{m_name}", member))
    return tuple(out)


def _summary(doc: str) -> str | None:
    """The first paragraph of a docstring with 4+ words of prose, on one line; a leading old-style
    signature (`f(x) -> y`, `f(x) -- does ...`) is cut off. None when it is over 600 characters."""
    for para in _paragraphs(inspect.cleandoc(doc)):
        text = re.sub(r"^[\w.]+\([^()]*\)\s*(?:-+>\s*\S+|-+)?\s*", "", " ".join(para.split()))
        if len(text) >= 20 and len(text.split()) >= 4:
            return text[0].upper() + text[1:] if len(text) <= 600 else None
    return None


def _signature(name: str, obj) -> str | None:
    """`(a, b=1)` from inspect, else from a leading `name(...)` docstring line; None when neither
    gives stable text (a default's repr such as `<object at 0x...>` varies between runs)."""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        m = re.match(rf"{re.escape(name)}(\(.*?\))", obj.__doc__ or "")
        sig = m.group(1) if m else None
    return None if sig is None or "<" in sig or " at 0x" in sig else sig


def _code_records() -> list[dict]:
    templates = {"function": ("implement", "explain", "tests"), "class": ("implement_class", "explain")}
    out = []
    for kind, dotted, obj in _stdlib_api():
        summary, name = _summary(obj.__doc__), dotted.rsplit(".", 1)[1]
        sig = _signature(name, obj) if kind == "function" else None
        for template in templates.get(kind, ("explain", "tests")) if summary else ():
            if template != "implement" or sig is not None:
                content = _CODE_TEMPLATES[template].format(name=name, sig=sig, summary=summary, dotted=dotted)
                out.append(_record("code", template, dotted, content))
    return out


def _pydoc_passages() -> list[tuple[str, str]]:
    """(subject, passage): runs of consecutive paragraphs, PASSAGE_MIN_CHARS..PASSAGE_MAX_CHARS long
    and mostly prose, from topics no rag item draws on, without any paragraph the benchmark shows."""
    import pydoc_data.topics

    rag_topics, shown = set(), set()
    for category in ("rag", "summarization"):
        for item in load_category(category):
            rag_topics.update(re.findall(r"([\w-]+)#\d+", item["source"]) if category == "rag" else ())
            shown.update(normalize_text(p) for t in _user_texts(item) for p in _paragraphs(t))
    out = []
    for topic in sorted(set(pydoc_data.topics.topics) - rag_topics):
        runs, run = [], []
        for para in _paragraphs(pydoc_data.topics.topics[topic]):
            if normalize_text(para) in shown:  # a shown paragraph ends the run and is dropped
                runs, run = [*runs, run], []
            elif run and len("\n\n".join([*run, para])) > PASSAGE_MAX_CHARS:
                runs, run = [*runs, run], [para]
            else:
                run.append(para)
        passages = ["\n\n".join(r) for r in [*runs, run]]
        passages = [p for p in passages if PASSAGE_MIN_CHARS <= len(p) <= PASSAGE_MAX_CHARS]
        prose = [p for p in passages if sum(c.isalpha() or c == " " for c in p) >= 0.75 * len(p)]
        out += [(f"pydoc_data.{topic}.{k + 1}", p) for k, p in enumerate(prose)]
    return out


def _doc_records() -> list[dict]:
    passages = []  # (subject, title, question, text)
    for mod_name in STDLIB_MODULES:
        text = _trim(inspect.cleandoc(importlib.import_module(mod_name).__doc__ or ""))
        question = f"What is the `{mod_name}` module for, and what are its main parts?"
        passages.append((mod_name, f"the `{mod_name}` module", question, text))
    for _, dotted, obj in _stdlib_api():
        question = f"What does `{dotted}` do, what does it take, and what does it return?"
        passages.append((dotted, f"`{dotted}`", question, _trim(inspect.cleandoc(obj.__doc__))))
    for subject, text in _pydoc_passages():
        question = "What rules does this passage state? Give a short code example for each."
        passages.append((subject, "this part of the Python language reference", question, text))
    passages = [p for p in passages if len(p[3]) >= PASSAGE_MIN_CHARS]
    names, out = list(_DOC_TEMPLATES), []
    for i, (subject, title, question, text) in enumerate(passages):
        for template in (names[i % 4], names[(i + 1) % 4], names[(i + 2) % 4]):  # 3 of 4, rotating
            content = _DOC_TEMPLATES[template].format(title=title, question=question, text=text)
            out.append(_record("docs", template, subject, content))
    return out


def math_problem(index: int) -> tuple[str, str, int]:
    """(kind, question, integer answer) of the index-th generated training problem. The numbers
    come from sha256 of (TRAIN_MATH_SEED, index, name): the same on every platform."""
    kind = list(_MATH_KINDS)[index % len(_MATH_KINDS)]
    question, answer = _MATH_KINDS[kind]
    drawn = {
        k: int(lo) + _hash64(TRAIN_MATH_SEED, index, k) % (int(hi) - int(lo) + 1)
        for k, lo, hi in re.findall(r"\{(\w+):(\d+)-(\d+)\}", question)
    }
    who = _NAMES[_hash64(TRAIN_MATH_SEED, index, "who") % len(_NAMES)]
    return kind, re.sub(r"\{(\w+):\d+-\d+\}", r"{\1}", question).format(who=who, **drawn), answer(**drawn)


def _math_records() -> list[dict]:
    out = []
    for i in range(NUM_MATH):
        kind, question, answer = math_problem(i)
        suffix = _MATH_SUFFIXES[_hash64(TRAIN_MATH_SEED, i, "suffix") % len(_MATH_SUFFIXES)]
        out.append(_record("math", kind, str(i), question + suffix, answer=answer))
    return out


def _instruction_records() -> list[dict]:
    out = []
    for domain, groups in (("programming", PROGRAMMING_TOPICS), ("science", SCIENCE_TOPICS)):
        templates = {**_TOPIC_TEMPLATES, **_DOMAIN_TEMPLATES[domain]}
        for group in groups:
            for topic in group:
                out += [_record("instructions", n, topic, t.format(t=topic)) for n, t in templates.items()]
            for a, b in itertools.combinations(group, 2):
                out.append(_record("instructions", "compare", f"{a} | {b}", _COMPARE.format(a=a, b=b)))
    return out


_SOURCES = dict(code=_code_records, docs=_doc_records, math=_math_records, instructions=_instruction_records)
assert list(_SOURCES) == list(SOURCE_SHARES)


# ---------------------------------------------------------------------------------------------
# Disjointness from the benchmark


@functools.cache
def _benchmark() -> tuple[frozenset[str], tuple[str, ...]]:
    """(normalised benchmark texts, normalised HumanEval prompts)."""
    from specdecode.assets import load_prompt_set

    humaneval = {normalize_text(r["prompt"]) for r in load_prompt_set("humaneval", progress=False)}
    return frozenset(benchmark_texts()), tuple(sorted(humaneval))


def _overlaps(text: str) -> bool:
    texts, humaneval = _benchmark()
    norm = normalize_text(text)
    return norm in texts or any(len(p) <= len(norm) and p in norm for p in humaneval)


def check_disjoint(records: list[dict]) -> None:
    """Raise SpecDecodeError listing the ids of records whose user text equals a benchmark text
    (`benchmark_texts()`) or contains a benchmark HumanEval prompt."""
    bad = [str(r.get("id", f"#{i}")) for i, r in enumerate(records) if any(map(_overlaps, _user_texts(r)))]
    if bad:
        more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise SpecDecodeError(
            f"{len(bad)} training prompt(s) overlap the benchmark prompts (dataset version "
            f"{DATASET_VERSION}): {', '.join(bad[:20])}{more}. Remove them from the training set."
        )


# ---------------------------------------------------------------------------------------------
# Public API


@functools.cache
def _pools() -> dict[str, tuple[dict, ...]]:
    """Source -> its records, without benchmark overlaps and without texts seen before."""
    seen, pools = set(), {}
    for source, build in _SOURCES.items():
        pool = []
        for record in build():
            key = tuple(map(normalize_text, _user_texts(record)))
            if key not in seen and not any(map(_overlaps, _user_texts(record))):
                seen.add(key)
                pool.append(record)
        pools[source] = tuple(pool)
    return pools


def _quotas(num_prompts: int) -> dict[str, int]:
    """Largest-remainder split of num_prompts over SOURCE_SHARES (ties: source order)."""
    exact = {s: Fraction(str(share)) * num_prompts for s, share in SOURCE_SHARES.items()}
    quotas = {s: int(q) for s, q in exact.items()}
    by_remainder = sorted(exact, key=lambda s: quotas[s] - exact[s])  # stable: source order on ties
    for s in by_remainder[: num_prompts - sum(quotas.values())]:
        quotas[s] += 1
    return quotas


@functools.cache
def max_prompts() -> int:
    """The largest set the offline sources supply in the fixed mix."""
    pools = _pools()
    n = min(int(len(pools[s]) / share) for s, share in SOURCE_SHARES.items()) + 1
    while any(q > len(pools[s]) for s, q in _quotas(n).items()):
        n -= 1
    return n


def fingerprint(records: list[dict]) -> str:
    """Short sha256 of the records' ids and messages."""
    blob = json.dumps([[r["id"], r["messages"]] for r in records], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _is_heldout(record: dict, heldout_fraction: float) -> bool:
    return _hash64("heldout", *map(normalize_text, _user_texts(record))) < heldout_fraction * 2**64


def _check_params(num_prompts, heldout_fraction, seed) -> None:
    if type(num_prompts) is not int or not MIN_PROMPTS <= num_prompts <= max_prompts():
        available = ", ".join(f"{s} {len(p)}" for s, p in _pools().items())
        raise SpecDecodeError(
            f"num_prompts must be an integer from {MIN_PROMPTS} to {max_prompts()} (the maximum the offline "
            f"sources supply in the mix {SOURCE_SHARES}; distinct prompts: {available}), got {num_prompts!r}"
        )
    if type(heldout_fraction) not in (int, float) or not 0 < heldout_fraction <= 0.5:
        raise SpecDecodeError(f"heldout_fraction must be a number in (0, 0.5], got {heldout_fraction!r}")
    if type(seed) is not int:
        raise SpecDecodeError(f"seed must be an integer, got {seed!r}")


def build_prompt_set(num_prompts: int = 4000, heldout_fraction: float = 0.05, seed: int = 0) -> dict:
    """{"train": [...], "heldout": [...], "stats": {...}}: num_prompts fresh records in all."""
    _check_params(num_prompts, heldout_fraction, seed)
    pools, quotas = _pools(), _quotas(num_prompts)
    # 1. each source's quota: a prefix of its pool in seeded-hash order, so prefix-stable in n
    picked = [sorted(pools[s], key=lambda r: _hash64(seed, r["id"]))[: quotas[s]] for s in SOURCE_SHARES]
    # 2. interleave so that every prefix holds the sources in proportion
    keyed = [(Fraction(2 * j + 1, 2 * len(g)), gi, r) for gi, g in enumerate(picked) for j, r in enumerate(g)]
    records = copy.deepcopy([r for *_, r in sorted(keyed, key=lambda t: t[:2])])
    check_disjoint(records)  # the pools are filtered already: this guards the construction
    # 3. split on the text's hash alone, so a record's side does not depend on num_prompts or seed
    heldout = [r for r in records if _is_heldout(r, heldout_fraction)]
    train = [r for r in records if not _is_heldout(r, heldout_fraction)]
    sources = {s: {"share": share, "available": len(pools[s])} for s, share in SOURCE_SHARES.items()}
    for split, split_records in (("train", train), ("heldout", heldout)):
        for s in sources:
            sources[s][split] = sum(r["source"] == s for r in split_records)
    stats = dict(
        version=PROMPT_SET_VERSION,
        python=f"CPython {sys.version_info.major}.{sys.version_info.minor}",
        benchmark_dataset_version=DATASET_VERSION,
        num_prompts=num_prompts,
        num_train=len(train),
        num_heldout=len(heldout),
        heldout_fraction=heldout_fraction,
        seed=seed,
        sources=sources,
        fingerprint=fingerprint(train + heldout),
    )
    return {"train": train, "heldout": heldout, "stats": stats}


def write_prompt_set(out_dir: str | Path, *, overwrite: bool = False, **kw) -> Path:
    """Build a set (`kw` as for build_prompt_set), write it to out_dir and return out_dir."""
    out = Path(out_dir)
    built = build_prompt_set(**kw)
    files = {
        f"{split}.jsonl": "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in built[split])
        for split in ("train", "heldout")
    }
    sha = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}
    files["stats.json"] = json.dumps({**built["stats"], "files_sha256": sha}, indent=1) + "\n"
    if out.exists() and not out.is_dir():
        raise SpecDecodeError(f"{out} exists and is not a directory; choose a directory for the prompt set")
    existing = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if existing and not overwrite:
        if all((out / n).is_file() and (out / n).read_text(encoding="utf-8") == t for n, t in files.items()):
            return out  # this very set is already there
        raise SpecDecodeError(
            f"{out} is not empty and does not hold this prompt set (it has {', '.join(existing[:5])}"
            f"{', ...' if len(existing) > 5 else ''}); choose another directory or pass overwrite=True"
        )
    out.mkdir(parents=True, exist_ok=True)
    temps = {name: out / f".{name}.tmp{os.getpid()}" for name in files}
    try:  # all temp files first, then the renames (stats.json last: it marks a complete set)
        for name, text in files.items():
            temps[name].write_text(text, encoding="utf-8")
        for name, tmp in temps.items():
            os.replace(tmp, out / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return out
