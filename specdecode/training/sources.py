"""The offline text sources of the training prompt set: deterministic, no network, no model.

Contract: `SOURCES` maps each source to a function returning its records in a fixed order, mixed
in `SOURCE_SHARES` by `training.prompts`:
    code          implement / explain / write-tests tasks over the public functions, classes and
                  methods with a docstring of `STDLIB_MODULES` (walked with `inspect`)
    docs          summary / explanation / QA / key points over stdlib docstrings and passages of
                  `pydoc_data.topics`: none from a topic the benchmark's rag items use, none with a
                  paragraph a summarization or rag item shows, cut to another length (250-1500)
    math          generated integer word problems (own templates and `TRAIN_MATH_SEED`,
                  `math_problem(index)`); + `answer`
    instructions  writing / explaining / comparing templates over `PROGRAMMING_TOPICS`, `SCIENCE_TOPICS`
    chat          everyday assistant requests: writing, role-play, extraction, humanities,
                  advice, argument (`training.sources_chat`)
A record: `{"id": "<source>/<template>/<subject>", "source", "messages": [one user turn]}`
(+ `"answer"`: int, math only). `user_texts(record)` and `hash64(*parts)` are shared with
`training.prompts`. Docstrings and pydoc topics depend on the CPython minor version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import itertools
import re
import warnings

from specdecode.datasets import load_category, normalize_text

# Shares of the full mix. A set built from some of the sources (`build_prompt_set(sources=...)`)
# renormalises theirs: the four older sources alone give the first prompt set's 0.4/0.2/0.15/0.25.
SOURCE_SHARES = {"code": 0.32, "docs": 0.16, "math": 0.12, "instructions": 0.20, "chat": 0.20}
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


def hash64(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def user_texts(record: dict) -> list[str]:
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
# Sources: each returns its records in a fixed order; `prompts._pools` filters and deduplicates them.


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
    # Deferred: pydoc_data.topics is a large module, read only when the docs pool is built.
    import pydoc_data.topics

    rag_topics, shown = set(), set()
    for category in ("rag", "summarization"):
        for item in load_category(category):
            rag_topics.update(re.findall(r"([\w-]+)#\d+", item["source"]) if category == "rag" else ())
            shown.update(normalize_text(p) for t in user_texts(item) for p in _paragraphs(t))
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
        k: int(lo) + hash64(TRAIN_MATH_SEED, index, k) % (int(hi) - int(lo) + 1)
        for k, lo, hi in re.findall(r"\{(\w+):(\d+)-(\d+)\}", question)
    }
    who = _NAMES[hash64(TRAIN_MATH_SEED, index, "who") % len(_NAMES)]
    return kind, re.sub(r"\{(\w+):\d+-\d+\}", r"{\1}", question).format(who=who, **drawn), answer(**drawn)


def _math_records() -> list[dict]:
    out = []
    for i in range(NUM_MATH):
        kind, question, answer = math_problem(i)
        suffix = _MATH_SUFFIXES[hash64(TRAIN_MATH_SEED, i, "suffix") % len(_MATH_SUFFIXES)]
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


def _chat_records() -> list[dict]:
    from specdecode.training.sources_chat import chat_prompts  # it builds on this module's helpers

    return [_record("chat", template, subject, text) for template, subject, text in chat_prompts()]


SOURCES = dict(
    code=_code_records,
    docs=_doc_records,
    math=_math_records,
    instructions=_instruction_records,
    chat=_chat_records,
)
assert list(SOURCES) == list(SOURCE_SHARES)
