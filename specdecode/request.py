"""Requests, their per-slot decoding state, and emission (stop conditions, streamed text).

Contract:
- `GenerationRequest` is what a caller asks for; `GenerationResult` what it gets back once the
  request finishes; `StreamEvent` carries the new text and token ids of one step.
- `RunningRequest` is a request in a cache slot: its tokens, statistics, prefill progress and
  its two random streams, both seeded by `request.seed` (so nothing depends on the batch):
  `generator` (handed to the drafter, and used for per-step uniforms when rejection sampling
  stochastic drafts) and `sample_uniforms(t, n)`, a table of uniforms keyed by output position
  t (0 = first generated token) for sampling the target's own token at each position.
- `emit(run, new_ids, tokenizer, eos_ids)` appends verified tokens and applies the stop
  conditions token by token (EOS, max_new_tokens, stop strings, also inside an accepted block);
  tokens after a stop are dropped. Text that could still grow into a stop string, and
  incomplete UTF-8, is held back until it is settled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams
from specdecode.drafters.base import DraftRow
from specdecode.policy import PolicyState

# Uniforms of the position-keyed table are drawn in blocks of this many positions, always the
# same block size, so the table depends on the seed alone.
UNIFORM_BLOCK = 64
_MASK63 = 2**63 - 1


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int = 0
    id: str = "0"
    ignore_eos: bool = False


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
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0

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


def _verify_seed(seed: int) -> int:
    # A second stream from the same seed (a fixed odd multiplier keeps distinct seeds distinct).
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK63


@dataclass
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
    accepted: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    t_start: float = 0.0
    finish_reason: str | None = None
    # Chunked prefill: prompt tokens already in the cache, and the drafter's captured states.
    num_prefilled: int = 0
    hidden_parts: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [[n, d]]
    _verify_gen: torch.Generator = field(init=False, repr=False)
    _table: torch.Tensor = field(init=False, repr=False)  # [T] position-keyed uniforms

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.req.seed & _MASK63)
        self._verify_gen = torch.Generator().manual_seed(_verify_seed(self.req.seed))
        self._table = torch.empty(0)

    @property
    def prefill_done(self) -> bool:
        # The last prompt token is not prefilled: it opens the first verify block.
        return self.num_prefilled >= len(self.req.prompt_ids) - 1

    def row(self) -> DraftRow:
        return DraftRow(self.slot, self.token_ids, self.req.params, self.generator)

    def sample_uniforms(self, start: int, n: int) -> torch.Tensor:  # [n]
        """Uniforms for output positions start..start+n-1 (the same values whenever asked)."""
        while self._table.shape[0] < start + n:
            block = torch.rand(UNIFORM_BLOCK, generator=self._verify_gen)
            self._table = torch.cat([self._table, block])
        return self._table[start : start + n]


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
    text = tokenizer.decode(r.output_ids, skip_special_tokens=True)
    hold = 0
    for s in r.req.stop:
        cut = text.find(s, max(0, len(r.sent_text) - len(s)))
        if cut >= 0:
            text, r.finish_reason = text[:cut], "stop"
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
    visible = text[: len(text) - hold] if hold else text
    new_text = visible[len(r.sent_text) :] if visible.startswith(r.sent_text) else ""
    r.sent_text = r.sent_text + new_text
    event = StreamEvent(r.req.id, new_text, taken)
    if r.finish_reason is not None:
        event.result = make_result(r, text)
    return event


def trim_ids(tokenizer, ids: list[int], text: str) -> list[int]:
    """Shortest prefix of ids whose text covers `text` (used when a stop string cuts it)."""
    for n in range(len(ids) + 1):
        if len(tokenizer.decode(ids[:n], skip_special_tokens=True)) >= len(text):
            return ids[:n]
    return ids


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
    )
