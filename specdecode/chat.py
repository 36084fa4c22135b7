"""Prompt files, chat templates and per-prompt seeds.

Contract:
- `read_prompts_jsonl(path)` parses a JSONL file whose lines are `{"id": ..., "prompt": "..."}`
  or `{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}`, optionally with `"seed"`,
  `"max_new_tokens"`, `"stop"`. Any malformed line raises `SpecDecodeError` naming the file,
  the line number and what is wrong. Blank lines are skipped.
- `encode_prompt(tokenizer, item, chat)` turns one item into token ids, applying the
  tokenizer's chat template for messages (or for a plain prompt when `chat` is set).
- `derive_seed(base, index)` gives every prompt its own reproducible random stream, so copies
  of one prompt in a file give independent samples.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError


@dataclass
class PromptItem:
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()


def derive_seed(base: int, index: int) -> int:
    digest = hashlib.sha256(f"specdecode:{base}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise SpecDecodeError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise SpecDecodeError(
                f"{where}: messages[{i}] must be an object with string 'role' and 'content', got {m!r}"
            )
    return messages


def parse_item(obj, where: str, default_id: str) -> PromptItem:
    if not isinstance(obj, dict):
        raise SpecDecodeError(
            f"{where}: expected a JSON object with 'prompt' or 'messages', got {type(obj).__name__}"
        )
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        raise SpecDecodeError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    item = PromptItem(id=str(obj.get("id", default_id)))
    if has_p:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise SpecDecodeError(f"{where}: 'prompt' must be a non-empty string")
        item.prompt = obj["prompt"]
    else:
        item.messages = _check_messages(obj["messages"], where)
    if "seed" in obj:
        if not isinstance(obj["seed"], int) or isinstance(obj["seed"], bool) or obj["seed"] < 0:
            raise SpecDecodeError(f"{where}: 'seed' must be a non-negative integer, got {obj['seed']!r}")
        item.seed = obj["seed"]
    if "max_new_tokens" in obj:
        n = obj["max_new_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise SpecDecodeError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {n!r}")
        item.max_new_tokens = n
    if "stop" in obj:
        stop = obj["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise SpecDecodeError(f"{where}: 'stop' must be a non-empty string or a list of them")
        item.stop = tuple(stop)
    return item


def read_prompts_jsonl(path: str | Path) -> list[PromptItem]:
    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"prompts file {str(path)!r} does not exist")
    items, seen = [], set()
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecDecodeError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            item = parse_item(obj, where, default_id=str(len(items)))
            if item.id in seen:
                raise SpecDecodeError(f"{where}: duplicate id {item.id!r}; ids must be unique")
            seen.add(item.id)
            items.append(item)
    if not items:
        raise SpecDecodeError(f"prompts file {str(path)!r} has no prompts")
    return items


def encode_prompt(tokenizer, item: PromptItem, chat: bool = False) -> list[int]:
    messages = item.messages
    if messages is None and chat:
        messages = [{"role": "user", "content": item.prompt}]
    if messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise SpecDecodeError(
                f"prompt {item.id!r}: tokenizer has no chat template; drop --chat or give 'prompt'"
            )
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)
    return list(tokenizer(item.prompt)["input_ids"])
