"""OpenAI response bodies and server-sent-event chunks for a planned request.

Contract: `completion_body`, `completion_chunk`, `chat_body`, `chat_chunk` and `usage_chunk` build
the JSON OpenAI's clients expect for a `ParsedRequest` (ids `cmpl-<id>` / `chatcmpl-<id>`, the
served model's name, the request's creation time, `logprobs` always null); `usage(prompt,
completion)` counts tokens; `sse(obj)` frames one server-sent event.
"""

from __future__ import annotations

import json

from specdecode.engine.protocol import ParsedRequest


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def _head(p: ParsedRequest, chunk: bool) -> dict:
    chat = p.kind == "chat"
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{p.id}",
        "object": obj,
        "created": p.created,
        "model": p.model,
    }


def completion_body(p: ParsedRequest, choices: list[dict], use: dict) -> dict:
    """choices: [{"index", "text", "finish_reason"}]."""
    return {**_head(p, False), "choices": [{**c, "logprobs": None} for c in choices], "usage": use}


def completion_chunk(p: ParsedRequest, index: int, text: str, finish_reason: str | None) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(p, True), "choices": [choice]}


def chat_body(p: ParsedRequest, choices: list[dict], use: dict) -> dict:
    out = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "logprobs": None,
            "finish_reason": c["finish_reason"],
        }
        for c in choices
    ]
    return {**_head(p, False), "choices": out, "usage": use}


def chat_chunk(p: ParsedRequest, index: int, delta: dict, finish_reason: str | None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(p, True), "choices": [choice]}


def usage_chunk(p: ParsedRequest, use: dict) -> dict:
    return {**_head(p, True), "choices": [], "usage": use}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
