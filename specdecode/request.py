"""Requests, their per-slot decoding state, and emission (stop conditions, streamed text).

Contract:
- `GenerationRequest` is what a caller asks for; `GenerationResult` what it gets back once the
  request finishes; `StreamEvent` carries the new text and token ids of one step.
- `RunningRequest` is a request in a cache slot: its tokens, statistics, prefill progress and
  its two random streams, both seeded by all 64 bits of `request.seed` (so nothing depends on
  the batch):
  `generator` (handed to the drafter, and used for per-step uniforms when rejection sampling
  stochastic drafts) and `sample_uniforms(t, n)`, a table of uniforms keyed by output position
  t (0 = first generated token) for sampling the target's own token at each position.
- `emit(run, new_ids, tokenizer, eos_ids)` appends verified tokens and applies the stop
  conditions token by token (EOS, max_new_tokens, stop strings, also inside an accepted block);
  tokens after a stop are dropped. Text that could still grow into a stop string, and
  incomplete UTF-8, is held back until it is settled. Detokenization is incremental (a window
  of a few tokens before the new ones), so a step costs the same at any output length; the
  final text is one full decode. A request with `detokenize=False` gets ids only (empty text,
  no stop strings): what regeneration needs, without a tokenizer call per request per step.
- `fail(run, message)` ends a request with `finish_reason == "error"` and `result.error`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams
from specdecode.drafter import DraftRow
from specdecode.policy import PolicyState
from specdecode.sampling import seeded_generator

# Uniforms of the position-keyed table are drawn in blocks of this many positions, always the
# same block size, so the table depends on the seed alone.
UNIFORM_BLOCK = 64


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int = 0
    id: str = "0"
    ignore_eos: bool = False
    detokenize: bool = True  # False: token ids only, no text and no stop strings (regeneration)


@dataclass
class GenerationResult:
    id: str
    text: str
    token_ids: list[int]
    num_new_tokens: int
    num_steps: int
    tau: float  # tokens emitted per verification step (accepted + 1), before stop truncation
    accepted_per_position: list[int]  # how often draft position k (1-based: index k-1) was accepted
    reached_per_position: list[int]  # how often position k was checked (all earlier accepted)
    decode_time_s: float
    prefill_time_s: float
    tokens_per_s: float
    finish_reason: str  # "stop" (EOS or stop string), "length", or "error" (see `error`)
    prompt_tokens: int = 0
    error: str | None = None  # what ended the request when finish_reason == "error"
    num_drafted: int = 0  # draft tokens (chain positions or tree nodes) verified over all steps

    @property
    def acceptance_per_position(self) -> list[float]:
        """Conditional acceptance rate at each draft position."""
        return [
            a / r if r else 0.0
            for a, r in zip(self.accepted_per_position, self.reached_per_position, strict=True)
        ]

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["acceptance_per_position"] = [round(x, 4) for x in self.acceptance_per_position]
        return d


@dataclass
class StreamEvent:
    request_id: str
    text: str  # new text since the last event
    token_ids: list[int]  # new token ids since the last event
    result: GenerationResult | None = None  # set on the request's final event


@dataclass(eq=False)  # requests compare by identity
class RunningRequest:
    """A request in a slot (prefilling or decoding)."""

    req: GenerationRequest
    slot: int
    token_ids: list[int]  # prompt + output; the last one is not yet in the target cache
    generator: torch.Generator = field(init=False)
    policy_state: PolicyState = field(default_factory=PolicyState)
    output_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    num_steps: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    accepted: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    t_start: float = 0.0
    finish_reason: str | None = None
    error: str | None = None  # set when this request failed inside a step (ended by `fail`)
    # Incremental detokenization: text of output_ids[:read_offset] is `text`; the window for
    # the next decode starts at prefix_offset (a few tokens of context for merges and spaces).
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # Chunked prefill: prompt tokens already in the cache, and the drafter's captured states.
    num_prefilled: int = 0
    hidden_parts: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [[n, d]]
    # Prefix sharing: a request whose whole prompt but its last token another prefilling request
    # is computing waits for those rows (`share_rows`) and copies them (decode.py).
    share_from: RunningRequest | None = field(default=None, repr=False)
    share_rows: int = 0
    _verify_gen: torch.Generator = field(init=False, repr=False)
    _table: torch.Tensor = field(init=False, repr=False)  # [T] position-keyed uniforms

    def __post_init__(self) -> None:
        self.generator = seeded_generator(self.req.seed, stream=0)
        self._verify_gen = seeded_generator(self.req.seed, stream=1)
        self.policy_state.sampled = not self.req.params.greedy
        self._table = torch.empty(0)

    @property
    def prefill_done(self) -> bool:
        # The last prompt token is not prefilled: it opens the first verify block.
        return self.num_prefilled >= len(self.req.prompt_ids) - 1

    def row(self) -> DraftRow:
        return DraftRow(self.slot, self.token_ids, self.req.params, self.generator)

    def room(self) -> int:
        """Drafts this request can still use: the last emitted token is always the target's."""
        return max(0, self.req.max_new_tokens - len(self.output_ids) - 1)

    def sample_uniforms(self, start: int, n: int) -> torch.Tensor:  # [n]
        """Uniforms for output positions start..start+n-1 (the same values whenever asked)."""
        while self._table.shape[0] < start + n:
            block = torch.rand(UNIFORM_BLOCK, generator=self._verify_gen)
            self._table = torch.cat([self._table, block])
        return self._table[start : start + n]


def _decode_new(r: RunningRequest, tokenizer) -> str:
    """The text of all output ids, decoding only a window of the newest ones.

    Settled text (not ending in an incomplete UTF-8 character) is kept in `r.text`; the window
    starts one step back so that merges and leading spaces decode as in a full decode.
    """
    ids = r.output_ids
    prefix = tokenizer.decode(ids[r.prefix_offset : r.read_offset], skip_special_tokens=True)
    window = tokenizer.decode(ids[r.prefix_offset :], skip_special_tokens=True)
    new = window[len(prefix) :] if window.startswith(prefix) else window
    if new and not new.endswith("\ufffd"):
        r.text += new
        r.prefix_offset, r.read_offset = r.read_offset, len(ids)
        return r.text
    return r.text + new


def emit(r: RunningRequest, new_ids: list[int], tokenizer, eos_ids: set[int]) -> StreamEvent:
    """Append verified tokens to `r`, apply stop conditions, return what is new."""
    taken: list[int] = []
    for tok in new_ids:
        if tok in eos_ids and not r.req.ignore_eos:
            r.finish_reason = "stop"
            break
        taken.append(tok)
        if len(r.output_ids) + len(taken) >= r.req.max_new_tokens:
            r.finish_reason = "length"
            break
    r.output_ids.extend(taken)
    r.token_ids.extend(taken)
    if not r.req.detokenize:
        event = StreamEvent(r.req.id, "", taken)
        if r.finish_reason is not None:
            event.result = make_result(r, "")
        return event
    text = _decode_new(r, tokenizer)
    hold, cut_by_stop = 0, False
    for s in r.req.stop:
        cut = text.find(s, max(0, len(r.sent_text) - len(s)))
        if cut >= 0:
            text, r.finish_reason, cut_by_stop = text[:cut], "stop", True
            r.output_ids = trim_ids(tokenizer, r.output_ids, text)
            break
    if r.finish_reason is None:
        # Hold back a tail that could still grow into a stop string, and incomplete UTF-8.
        for s in r.req.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        if text.endswith("\ufffd"):
            hold = max(hold, 1)
    elif not cut_by_stop:
        text = tokenizer.decode(r.output_ids, skip_special_tokens=True)  # the final text: one full decode
    visible = text[: len(text) - hold] if hold else text
    new_text = visible[len(r.sent_text) :] if visible.startswith(r.sent_text) else ""
    r.sent_text = r.sent_text + new_text
    event = StreamEvent(r.req.id, new_text, taken)
    if r.finish_reason is not None:
        event.result = make_result(r, text)
    return event


def fail(r: RunningRequest, message: str) -> StreamEvent:
    """End `r` with an error (what was already streamed stays streamed)."""
    r.finish_reason, r.error = "error", message
    return StreamEvent(r.req.id, "", [], result=make_result(r, r.sent_text))


def trim_ids(tokenizer, ids: list[int], text: str) -> list[int]:
    """Shortest prefix of ids whose text covers `text` (used when a stop string cuts it).

    Binary search: the decoded length of a prefix grows with the prefix."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= len(text):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]


def make_result(r: RunningRequest, text: str) -> GenerationResult:
    dt = time.perf_counter() - r.t_start
    n = len(r.output_ids)
    return GenerationResult(
        id=r.req.id,
        text=text,
        token_ids=list(r.output_ids),
        num_new_tokens=n,
        num_steps=r.num_steps,
        tau=r.num_emitted / max(r.num_steps, 1),
        accepted_per_position=list(r.accepted),
        reached_per_position=list(r.reached),
        decode_time_s=dt,
        prefill_time_s=r.prefill_time,
        tokens_per_s=n / dt if dt > 0 else 0.0,
        finish_reason=r.finish_reason or "length",
        prompt_tokens=len(r.req.prompt_ids),
        error=r.error,
        num_drafted=r.num_drafted,
    )
