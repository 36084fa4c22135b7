"""Request scheduling around the speculative step: admission, chunked prefill, slots, emission.

Contract:
- `SpeculativeDecoder(target, drafter, policy)` decodes `GenerationRequest`s, all at once
  (`stream()` yields a `StreamEvent` per request per step, `generate()` returns the results in
  request order) or step by step for a serving engine: `add_request()`, `abort()`,
  `step() -> events`; `stream()` is a thin loop over `step()`. One thread drives a decoder.
- Up to `max_batch` requests hold cache slots; a finished or aborted request frees its slot at
  once and the next waiting one is admitted between steps. A prompt is prefilled in chunks of
  `prefill_chunk` tokens. While other requests decode, each prefilling request's next chunk
  rides in the step's verify forward (`models.base.forward_packed`), at most `prefill_budget`
  prompt tokens a step when it is set (times the number of prefilling requests per running
  one, rounded up), else `prefill_chunk`; so running requests keep streaming while a long
  prompt is read, and a short one costs the rows it adds to a forward. An idle decoder reads
  every waiting prompt at once, chunks packed into forwards of up to `prefill_chunk` tokens.
- Prefix sharing (`share_prefix`, on by default; caches with `copy_prefix`): a request admitted
  while another holds the first n >= `MIN_SHARED_ROWS` tokens of its prompt in the cache (a
  running request's prompt and output, a prefilling one's rows so far) copies those rows
  instead of computing them; one whose whole prompt but its last token another prefilling
  request is computing (the samples of one prompt, a repeated request) waits for those rows and
  prefills nothing. A copied row is the row its source computed, so outputs are what each
  request gives alone, up to the batch rounding of products (exactly equal in fp32 tests).
  Drafters that read the target's hidden states copy them too, from prefilling sources only.
- Each decode step is one `step.speculate(batch, riders)` over every running request (ragged
  K): propose -> verify forward -> verify -> commit -> advance (step.py).
- Output distribution is exactly the target's (verification is lossless); at T = 0 the tokens
  equal greedy decoding. Randomness (request.py, verify.py): the target's token at output
  position t is sampled with a uniform keyed by (seed, t). Point-mass drafts (ar, n-gram) and
  `verify_mode="match"` are verified by sample-then-match against those uniforms, which for a
  point mass accepts with the same probability p(x) as rejection sampling: the output is then
  the target's own sample for that seed, whatever K, policy or batch. Stochastic drafts under
  block verification (the default) or token-wise rejection sampling (and trees) use per-step
  uniforms from the request's generator, so the request decodes the same in any batch given the
  same K each step; a load-dependent policy (`scheduled`) keeps the distribution exact but may
  change which sample a seed gives.
- Stop conditions (EOS, stop strings, max_new_tokens) are applied token by token inside an
  accepted block; tokens after the stop are dropped.
- A failure inside one request ends that request, never the batch: a row whose target logits
  (or draft probabilities) are not finite, or whose emission raises, finishes with
  `finish_reason == "error"` and `result.error` saying what happened; its neighbours' rows are
  verified and emitted exactly as without it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from specdecode.drafter import Drafter
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Segment, forward_packed
from specdecode.policy import DraftPolicy, FixedK
from specdecode.request import (
    GenerationRequest,
    GenerationResult,
    RunningRequest,
    StreamEvent,
    emit,
    fail,
)
from specdecode.step import StepStats, speculate
from specdecode.verify import Verdict

__all__ = ["GenerationRequest", "GenerationResult", "SpeculativeDecoder", "StepStats", "StreamEvent"]

log = logging.getLogger("specdecode.decode")

PREFILL_CHUNK = 512
MIN_SHARED_ROWS = 16  # shorter common prefixes are computed, not copied
VERIFY_MODES = ("block", "rejection", "match")


class SpeculativeDecoder:
    def __init__(
        self,
        target,  # specdecode.models.loader.LoadedModel
        drafter: Drafter,
        policy: DraftPolicy | None = None,
        max_batch: int = 8,
        verify_mode: str = "block",
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_budget: int | None = None,
        share_prefix: bool = True,
    ):
        if verify_mode not in VERIFY_MODES:
            raise SpecDecodeError(
                f"unknown verify mode {verify_mode!r}; choose one of: {', '.join(VERIFY_MODES)}"
            )
        if max_batch < 1:
            raise SpecDecodeError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1 or (prefill_budget is not None and prefill_budget < 1):
            raise SpecDecodeError("prefill_chunk and prefill_budget must be >= 1")
        self.target, self.model, self.tokenizer = target, target.model, target.tokenizer
        self.drafter = drafter
        self.policy = policy if policy is not None else FixedK(0)
        # Whether any request may draft: if not, drafters need not read prompts (`Drafter.prefill`).
        self._may_draft = self.policy.k_max > 0 and self.policy.enabled
        self.max_batch, self.verify_mode = max_batch, verify_mode
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        self.share_prefix = share_prefix
        self.shared_tokens = 0  # prompt rows copied from another request instead of computed
        self.vocab_size = target.vocab_size
        self.eos_ids = set(target.eos_token_ids)
        self.cache, self._cache_shape, self._reserved = None, (0, 0), False
        self.draft_time = self.verify_time = 0.0
        self.last_step = StepStats()
        self._waiting: deque[GenerationRequest] = deque()
        self._prefilling: list[RunningRequest] = []
        self._running: list[RunningRequest] = []
        self._free: list[int] = []

    # ---- set-up -------------------------------------------------------------------------
    @property
    def k_max(self) -> int:
        return self.policy.k_max

    def _rows_needed(self, req: GenerationRequest) -> int:
        return len(req.prompt_ids) + req.max_new_tokens + self.k_max + 2

    def check_request(self, req: GenerationRequest) -> None:
        """Raise SpecDecodeError (saying what to fix) for a request this decoder cannot serve."""
        ctx = self.model.info.max_position
        if len(req.prompt_ids) == 0:
            raise SpecDecodeError(f"request {req.id!r}: the prompt is empty; give at least one token of text")
        if req.max_new_tokens < 1:
            raise SpecDecodeError(
                f"request {req.id!r}: max_new_tokens must be >= 1, got {req.max_new_tokens}"
            )
        if req.stop and not req.detokenize:
            raise SpecDecodeError(
                f"request {req.id!r}: stop strings need text; keep detokenize on or stop on token ids (EOS)"
            )
        if len(req.prompt_ids) + req.max_new_tokens > ctx:
            raise SpecDecodeError(
                f"request {req.id!r}: prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.max_new_tokens}) exceeds the model's context of {ctx} tokens; "
                "shorten the prompt or lower max_new_tokens"
            )
        if self._reserved and self._rows_needed(req) > self._cache_shape[1]:
            limit = self._cache_shape[1] - self.k_max - 2
            raise SpecDecodeError(
                f"request {req.id!r}: prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.max_new_tokens}) exceeds the served context of {limit} tokens; "
                "shorten the prompt or lower max_new_tokens"
            )

    def reserve(self, num_slots: int, max_len: int) -> None:
        """Allocate the cache once, for serving: `num_slots` requests of up to `max_len` rows."""
        if self.has_unfinished():
            raise SpecDecodeError("cannot resize the cache while requests are in flight")
        cap = self.model.info.max_slots
        if cap is not None and num_slots > cap:
            raise SpecDecodeError(
                f"{self.model.info.arch} serves at most {cap} request(s) at a time; "
                f"lower --max-batch to {cap}"
            )
        self._allocate(num_slots, max_len)
        self._reserved = True

    def _allocate(self, num_slots: int, max_len: int) -> None:
        self._cache_shape = (num_slots, max_len)
        self.cache = self.model.new_cache(num_slots, max_len)
        self.drafter.setup(num_slots, max_len)
        self._free = list(range(num_slots - 1, -1, -1))

    def _ensure_cache(self, requests: list[GenerationRequest]) -> None:
        """Grow the cache for `requests` (only while no slot is in use)."""
        need_len = max(self._rows_needed(r) for r in requests)
        need_len = min(need_len, self.model.info.max_position + self.k_max + 2)
        slots = min(self.max_batch, len(requests))
        if slots > self._cache_shape[0] or need_len > self._cache_shape[1]:
            self._allocate(max(slots, self._cache_shape[0]), max(need_len, self._cache_shape[1]))

    # ---- step-wise API ------------------------------------------------------------------
    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request; it is admitted into a free slot by a later `step()`."""
        self.check_request(req)
        self._waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or in-flight request and free its slot; False if it is not here."""
        for req in self._waiting:
            if req.id == request_id:
                self._waiting.remove(req)
                return True
        for group in (self._prefilling, self._running):
            for r in group:
                if r.req.id == request_id:
                    group.remove(r)
                    self._release(r, started=group is self._running)
                    return True
        return False

    def abort_all(self) -> list[str]:
        """Drop every request (e.g. after an error); returns their ids."""
        ids = [r.id for r in self._waiting] + [r.req.id for r in self._prefilling + self._running]
        for rid in ids:
            self.abort(rid)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return len(self._prefilling) + len(self._running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def _release(self, r: RunningRequest, started: bool) -> None:
        if started:
            self.drafter.stop(r.slot)
        self.cache.reset(r.slot)
        self._free.append(r.slot)

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """Admit, prefill (within the budget), decode one step; returns the new events."""
        stats = self.last_step = StepStats()
        # 1. Admission into free slots (an idle, unreserved decoder first sizes its cache).
        if not self._reserved and self._waiting and not self._prefilling and not self._running:
            self._ensure_cache(list(self._waiting))
        while self._waiting and self._free and self.num_active < self.max_batch:
            if not self._reserved and self._rows_needed(self._waiting[0]) > self._cache_shape[1]:
                break  # waits until the decoder is idle and the cache can grow
            req = self._waiting.popleft()
            r = RunningRequest(req, self._free.pop(), list(req.prompt_ids))
            r.hidden_parts = {i: [] for i in self.drafter.needs_hidden}
            self.cache.reset(r.slot)
            self._prefilling.append(r)
            self._share_prefix(r)
        # 2. Chunked prefill. While others decode, the next chunk of each prefilling request
        # (one per request, `budget` tokens in all) rides in the decode step's forward. The budget
        # grows with the number of prompts waiting per running request: a burst of arrivals
        # behind one running request is read quickly (the batch fills up), while a full batch is
        # stalled by at most one chunk per step. An idle batch reads its prompts at once, their
        # chunks packed into forwards of up to `prefill_chunk` tokens.
        t0 = time.perf_counter()
        for r in [r for r in self._prefilling if r.prefill_done]:  # one-token prompts
            self._start(r)
            self._prefilling.remove(r)
            self._running.append(r)
        riders: list[tuple[RunningRequest, int]] = []  # (request, chunk size)
        idle = not self._running
        if not idle:
            budget = None
            if self.prefill_budget:
                reading = sum(r.share_from is None for r in self._prefilling)  # sharers wait, read nothing
                budget = self.prefill_budget * -(-reading // len(self._running))
            riders = self._chunks(budget)
        while idle and self._prefilling:
            chunks = self._chunks(None)
            if not chunks:  # only waiting sharers left: their source was aborted before they resolved
                self._resolve_shares(force=True)
                continue
            segments = [self._chunk_segment(r, n) for r, n in chunks]
            t1 = time.perf_counter()
            outs = forward_packed(self.model, self.cache, segments)
            self._chunks_done(chunks, outs, time.perf_counter() - t1)
        # Rows in slot order: a full batch reads the cache as one contiguous range (no copies).
        self._running.sort(key=lambda r: r.slot)
        stats.prefill_s = time.perf_counter() - t0
        if not self._running:
            return []
        # 3. One decode step for every running request (the riders' chunks in its forward), then
        # emission and stop conditions.
        t0 = time.perf_counter()
        verdicts, rider_outs = self._step(self._running, [self._chunk_segment(r, n) for r, n in riders])
        self.draft_time += stats.draft_s
        self.verify_time += stats.verify_s
        events, still = [], []
        for r, v in zip(self._running, verdicts, strict=True):
            try:
                event = fail(r, r.error) if r.error else emit(r, v.emitted_ids, self.tokenizer, self.eos_ids)
            except Exception:  # one request's emission (detokenizer, stop strings) must not end others
                log.exception("request %s: emission failed", r.req.id)
                event = fail(r, "internal error while emitting tokens; the request was ended")
            if event.text or event.token_ids or event.result:
                events.append(event)
            if r.finish_reason is None:
                still.append(r)
            else:
                self._release(r, started=True)
        self._running = still
        self._chunks_done(riders, rider_outs, time.perf_counter() - t0)
        return events

    def _chunks(self, budget: int | None) -> list[tuple[RunningRequest, int]]:
        """The next chunk of each prefilling request in turn, `budget` tokens in all (None:
        `prefill_chunk`): (request, tokens of its prompt the chunk holds)."""
        left = self.prefill_chunk if budget is None else budget
        chunks = []
        for r in self._prefilling:
            if left <= 0:
                break
            if r.share_from is not None:  # waits for its source's rows
                continue
            size = min(self.prefill_chunk, len(r.req.prompt_ids) - 1 - r.num_prefilled, left)
            chunks.append((r, size))
            left -= size
        return chunks

    def _chunk_segment(self, r: RunningRequest, size: int) -> Segment:
        """The forward segment of r's next prompt chunk of `size` tokens (no logits)."""
        start = r.num_prefilled
        dev = self.model.info.device
        ids = torch.tensor([r.req.prompt_ids[start : start + size]], dtype=torch.long, device=dev)  # [1, N]
        pos = torch.arange(start, start + size, device=dev)[None]  # [1, N]
        return Segment(ids, pos, [r.slot], capture=self.drafter.needs_hidden, logits=False)

    def _chunks_done(self, chunks: list[tuple[RunningRequest, int]], outs: list, dt: float) -> None:
        """Commit prefilled chunks (their forward took `dt` s); a request whose prompt is in the
        cache starts decoding."""
        for (r, size), out in zip(chunks, outs, strict=True):
            self.cache.commit(r.slot, size)
            for i in self.drafter.needs_hidden:
                r.hidden_parts[i].append(out.hidden[i][0])  # [N, d]
            r.num_prefilled += size
            r.prefill_time += dt
            self.last_step.prefill_tokens += size
        self._resolve_shares()
        for r in [r for r in self._prefilling if r.prefill_done]:
            self._start(r)
            self._prefilling.remove(r)
            self._running.append(r)

    # ---- prefix sharing -------------------------------------------------------------------
    def _cached_ids(self, o: RunningRequest) -> tuple[list[int], list[int]]:
        """Token ids whose rows o holds in the cache now, and those it will hold when its prompt
        is prefilled (the same for a running request)."""
        if _holds(self._running, o):
            return o.token_ids[: self.cache.used(o.slot)], []
        return o.req.prompt_ids[: o.num_prefilled], o.req.prompt_ids[:-1]

    def _share_prefix(self, r: RunningRequest) -> None:
        """Copy the longest prefix of r's prompt that another request holds (module docstring),
        or wait for a prefilling request that will hold all of it."""
        want = len(r.req.prompt_ids) - 1  # the last prompt token opens the first verify block
        if not self.share_prefix or want < MIN_SHARED_ROWS or not hasattr(self.cache, "copy_prefix"):
            return
        prompt = r.req.prompt_ids[:want]
        hidden = bool(self.drafter.needs_hidden)
        best, src, later = 0, None, None
        for o in self._prefilling + self._running:
            if o is r or o.share_from is not None or (hidden and _holds(self._running, o)):
                continue
            now, then = self._cached_ids(o)
            n = _common_prefix(prompt, now)
            if n > best:
                best, src = n, o
            if best < want and later is None and len(then) >= want and then[:want] == prompt:
                later = o
        if best == want or (best >= MIN_SHARED_ROWS and later is None):
            self._copy_prefix(r, src, best)
        elif later is not None:
            r.share_from, r.share_rows = later, want

    def _copy_prefix(self, r: RunningRequest, src: RunningRequest, n: int) -> None:
        self.cache.copy_prefix(src.slot, r.slot, n)
        for i in self.drafter.needs_hidden:
            r.hidden_parts[i] = [torch.cat(src.hidden_parts[i])[:n]]  # [n, d]
        r.num_prefilled = n
        self.shared_tokens += n

    def _resolve_shares(self, force: bool = False) -> None:
        """Waiting sharers copy their rows once the source holds them; a sharer whose source has
        gone (aborted, failed) prefills on its own."""
        for r in self._prefilling:
            src = r.share_from
            if src is None:
                continue
            alive = _holds(self._prefilling, src)
            if alive and src.num_prefilled >= r.share_rows:
                self._copy_prefix(r, src, r.share_rows)
            elif alive and not force:
                continue
            r.share_from = None

    def _start(self, r: RunningRequest) -> None:
        """r's prompt is in the cache: the drafter starts on it, and so does r's decode clock."""
        hidden = {i: torch.cat(p) if p else None for i, p in r.hidden_parts.items()}  # layer -> [P-1, d]
        r.hidden_parts = {}
        t0 = time.perf_counter()
        self.drafter.start(r.slot, list(r.req.prompt_ids), hidden)
        if self._may_draft and r.req.max_new_tokens > 1:  # the drafter reads the prompt now
            self.drafter.prefill(r.slot, list(r.req.prompt_ids))
        r.t_start = time.perf_counter()
        r.prefill_time += r.t_start - t0

    def _step(self, running: list[RunningRequest], riders: list[Segment]) -> tuple[list[Verdict], list]:
        return speculate(
            running,
            self.model,
            self.cache,
            self.drafter,
            self.policy,
            self.vocab_size,
            self.verify_mode,
            self.last_step,
            riders,
        )

    # ---- offline API --------------------------------------------------------------------
    def stream(self, requests: Iterable[GenerationRequest]) -> Iterator[StreamEvent]:
        requests = list(requests)
        if not requests:
            return
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise SpecDecodeError("request ids must be unique within one call")
        if self.has_unfinished():
            raise SpecDecodeError("this decoder is busy with other requests; stream() needs it idle")
        for req in requests:
            self.check_request(req)
        if not self._reserved:
            self._ensure_cache(requests)
        for req in requests:
            self.add_request(req)
        try:
            while self.has_unfinished():
                yield from self.step()
        finally:
            self.abort_all()  # the consumer stopped early: release the slots

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = {}
        for event in self.stream(requests):
            if event.result is not None:
                results[event.request_id] = event.result
        return [results[r.id] for r in requests]


def _holds(group: list[RunningRequest], r: RunningRequest) -> bool:
    """Whether `r` itself (not an equal request) is in `group`."""
    return any(x is r for x in group)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(diff.argmax()) if diff.any() else n
