"""The speculative decoding loop: draft, verify in one target forward, commit, emit.

Contract:
- `SpeculativeDecoder(target, drafter, policy)` decodes `GenerationRequest`s, all at once
  (`stream()` yields a `StreamEvent` per request per step, `generate()` returns the results in
  request order) or step by step for a serving engine: `add_request()`, `abort()`,
  `step() -> events`; `stream()` is a thin loop over `step()`. One thread drives a decoder.
- Up to `max_batch` requests hold cache slots; a finished or aborted request frees its slot at
  once and the next waiting one is admitted between steps. A prompt is prefilled in chunks of
  `prefill_chunk` tokens; with `prefill_budget` set, at most that many prompt tokens are
  prefilled per step while other requests are decoding (chunked prefill; times the number of
  prefilling requests per running one, rounded up), so running requests keep streaming while a
  long prompt is read.
- Each decode step is one target forward over `[last token, drafts...]` for every running
  request (ragged K). The target cache holds every committed token except each request's last
  one, which opens the next verify block; so a step with no drafts is exactly plain
  autoregressive decoding (`ar`).
- K per request comes from `policy.choose(states)`; each state carries the request's context
  length and room first. A policy with `truncate(states, confidences, num_draft)` may shorten a
  chain whose drafter reports per-position confidences (`Proposal.extras["confidences"]`,
  [B, K]); it sees only values known before each draft token was drawn, so it stays lossless.
  A drafter that declares `provides_confidences = True` is asked for `policy.bounds(states)`.
- Output distribution is exactly the target's (verification is lossless); at T = 0 the tokens
  equal greedy decoding. Randomness (request.py): the target's token at output position t is
  sampled with a uniform keyed by (seed, t). Point-mass drafts (ar, n-gram) and
  `verify_mode="match"` are verified by sample-then-match against those uniforms, which for a
  point mass accepts with the same probability p(x) as rejection sampling: the output is then
  the target's own sample for that seed, whatever K, policy or batch. Stochastic drafts under
  rejection sampling (and trees) use per-step uniforms from the request's generator, so the
  request decodes the same in any batch given the same K each step; a load-dependent policy
  (`scheduled`) keeps the distribution exact but may change which sample a seed gives.
- Stop conditions (EOS, stop strings, max_new_tokens) are applied token by token inside an
  accepted block; tokens after the stop are dropped.
- A failure inside one request ends that request, never the batch: a row whose target logits
  (or draft probabilities) are not finite, or whose emission raises, finishes with
  `finish_reason == "error"` and `result.error` saying what happened; its neighbours' rows are
  verified and emitted exactly as without it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from specdecode.drafters.base import Drafter, Proposal, empty_proposal
from specdecode.errors import SpecDecodeError
from specdecode.policy import FixedK
from specdecode.request import (
    GenerationRequest,
    GenerationResult,
    RunningRequest,
    StreamEvent,
    emit,
    fail,
)
from specdecode.sampling import finite_rows, process_logits_batch
from specdecode.tree import DraftTree, tree_attention_mask, tree_depths
from specdecode.verify import verify_chain, verify_chain_match, verify_tree

__all__ = ["GenerationRequest", "GenerationResult", "SpeculativeDecoder", "StepStats", "StreamEvent"]

log = logging.getLogger("specdecode.decode")

PREFILL_CHUNK = 512
VERIFY_MODES = ("rejection", "match")


@dataclass
class StepStats:
    """What the last `step()` did (read by the serving engine's metrics)."""

    num_rows: int = 0  # requests decoded
    block: int = 0  # tokens per request in the verify forward (rows are padded to it)
    num_draft: int = 0  # draft tokens verified
    num_accepted: int = 0
    num_emitted: int = 0  # tokens emitted, before stop truncation
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0


class SpeculativeDecoder:
    def __init__(
        self,
        target,  # specdecode.models.loader.LoadedModel
        drafter: Drafter,
        policy=None,
        max_batch: int = 8,
        verify_mode: str = "rejection",
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_budget: int | None = None,
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
        self.max_batch, self.verify_mode = max_batch, verify_mode
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
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
        return getattr(self.policy, "k_max", 0)

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
        # 2. Chunked prefill. The budget only applies while others are decoding, and grows with
        # the number of prompts waiting per running request: a burst of arrivals behind one
        # running request is read quickly (the batch fills up), while a full batch is stalled
        # by at most one chunk per step.
        t0 = time.perf_counter()
        budget = None
        if self.prefill_budget and self._running:
            budget = self.prefill_budget * -(-len(self._prefilling) // len(self._running))
        for r in list(self._prefilling):
            budget = self._prefill(r, budget)
            if r.prefill_done:
                self._prefilling.remove(r)
                self._running.append(r)
            if budget is not None and budget <= 0:
                break
        # Rows in slot order: a full batch reads the cache as one contiguous range (no copies).
        self._running.sort(key=lambda r: r.slot)
        stats.prefill_s = time.perf_counter() - t0
        if not self._running:
            return []
        # 3. One decode step for every running request, then emission and stop conditions.
        emitted = self._step(self._running)
        events, still = [], []
        for r, new_ids in zip(self._running, emitted, strict=True):
            try:
                event = fail(r, r.error) if r.error else emit(r, new_ids, self.tokenizer, self.eos_ids)
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
        return events

    def _prefill(self, r: RunningRequest, budget: int | None) -> int | None:
        """Prefill chunks of r's prompt (all but its last token) within `budget` tokens."""
        t0 = time.perf_counter()
        prompt = r.req.prompt_ids
        dev = self.model.info.device
        capture = self.drafter.needs_hidden
        end = len(prompt) - 1
        while r.num_prefilled < end and (budget is None or budget > 0):
            start = r.num_prefilled
            size = min(self.prefill_chunk, end - start, budget if budget is not None else end)
            ids = torch.tensor([prompt[start : start + size]], dtype=torch.long, device=dev)  # [1, N]
            pos = torch.arange(start, start + size, device=dev)[None]  # [1, N]
            out = self.model.forward(ids, pos, self.cache, [r.slot], logits=False, capture=capture)
            self.cache.commit(r.slot, size)
            for i in capture:
                r.hidden_parts[i].append(out.hidden[i][0])  # [N, d]
            r.num_prefilled += size
            self.last_step.prefill_tokens += size
            if budget is not None:
                budget -= size
        r.prefill_time += time.perf_counter() - t0
        if r.prefill_done:
            hidden = {i: torch.cat(p) if p else None for i, p in r.hidden_parts.items()}  # layer -> [P-1, d]
            r.hidden_parts = {}
            self.drafter.start(r.slot, list(prompt), hidden)
            r.t_start = time.perf_counter()
        return budget

    # ---- one step -----------------------------------------------------------------------
    def _budget(self, r: RunningRequest, k: int) -> int:
        # Never draft past max_new_tokens: the last emitted token is always the target's.
        return max(0, min(k, r.req.max_new_tokens - len(r.output_ids) - 1))

    def _choose(self, running: list[RunningRequest]) -> list[int]:
        states = [r.policy_state for r in running]
        for r, st in zip(running, states, strict=True):
            st.context_len = len(r.token_ids)
            st.room = self._budget(r, 1 << 30)
        if getattr(self.drafter, "provides_confidences", False) and hasattr(self.policy, "bounds"):
            ks = self.policy.bounds(states)
        else:
            ks = self.policy.choose(states)
        return [self._budget(r, k) for r, k in zip(running, ks, strict=True)]

    def _truncate(self, running: list[RunningRequest], prop: Proposal) -> Proposal:
        """The proposal the policy keeps, if the drafter reported confidences for a chain."""
        conf = prop.extras.get("confidences")  # [B, K]
        if conf is None or prop.parents is not None or not hasattr(self.policy, "truncate"):
            return prop
        nd = prop.num_draft.cpu()
        ks = self.policy.truncate([r.policy_state for r in running], conf, nd.tolist())
        num = torch.minimum(nd, torch.tensor(ks, dtype=torch.long))
        k = int(num.max()) if len(num) else 0
        q = None if prop.draft_probs is None else prop.draft_probs[:, :k]
        return dataclasses.replace(prop, draft_ids=prop.draft_ids[:, :k], num_draft=num, draft_probs=q)

    @torch.inference_mode()
    def _step(self, running: list[RunningRequest]) -> list[list[int]]:
        """One draft -> verify -> commit round; returns the emitted token ids per request."""
        rows = [r.row() for r in running]
        # 1. Draft lengths and drafts (then the policy may shorten a chain by its confidences).
        ks = self._choose(running)
        t0 = time.perf_counter()
        prop = self.drafter.propose(rows, ks) if any(ks) else empty_proposal(len(rows))
        vprop = self._truncate(running, prop)
        t1 = time.perf_counter()
        # 2. One target forward over [last token, drafts...] per request.
        out, num_draft, depths = self._verify_forward(running, vprop)
        # 3. Verification (lossless), then commit the kept rows; a row that cannot be verified
        # (non-finite numbers) ends its own request.
        vprop, logits = self._isolate_failures(running, vprop, out.logits)
        if vprop.parents is None:
            accepted, emitted = self._verify(running, vprop, logits, num_draft)
            for r, n_acc in zip(running, accepted, strict=True):
                self.cache.commit(r.slot, n_acc + 1)
        else:
            accepted, emitted = self._verify_tree(running, vprop, logits, num_draft)
            prop.accepted_nodes = vprop.accepted_nodes
        t_adv = time.perf_counter()
        self.drafter.advance(rows, prop, accepted, out)
        t2 = time.perf_counter()
        self.draft_time += t1 - t0
        self.verify_time += t2 - t1
        if hasattr(self.policy, "observe_step"):  # online step costs
            # A round's own cost leaves out catching up on context and advance(), paid every step.
            context = max(len(r.token_ids) for r in running)
            draft_s = max(t1 - t0 - prop.catch_up_s, 0.0)
            self.policy.observe_step(len(running), vprop.max_k + 1, context, prop.max_k, draft_s, t_adv - t1)
        # 4. Statistics for the policy and the report (per depth: a chain's depth is its length).
        st = self.last_step
        st.num_rows, st.block, st.draft_s, st.verify_s = len(running), vprop.max_k + 1, t1 - t0, t2 - t1
        for b, r in enumerate(running):
            n, n_acc = int(depths[b]), accepted[b]
            self.policy.observe(r.policy_state, n, n_acc)
            st.num_draft += int(num_draft[b])
            st.num_accepted += n_acc
            st.num_emitted += n_acc + 1
            r.num_steps += 1
            r.num_emitted += n_acc + 1
            for j in range(n):
                if j >= len(r.reached):
                    r.reached.append(0)
                    r.accepted.append(0)
                r.reached[j] += j <= n_acc
                r.accepted[j] += j < n_acc
        return emitted

    def _isolate_failures(self, running: list[RunningRequest], prop: Proposal, logits: torch.Tensor):
        """Mark rows with non-finite target logits or draft probabilities as failed, and give them
        harmless numbers so the batch's verification runs on (their output is discarded)."""
        ok_p = finite_rows(logits[..., : self.vocab_size])  # [B]
        q = prop.draft_probs  # [B, K, V] or None
        ok_q = torch.ones_like(ok_p)  # [B]
        if q is not None and q.shape[1] > 0:
            ok_q = torch.isfinite(q).flatten(1).all(dim=1).to(ok_p.device)
        ok = ok_p & ok_q
        if bool(ok.all()):
            return prop, logits
        bad = ~ok  # [B]
        for b in bad.nonzero().flatten().tolist():
            what = "target logits" if not bool(ok_p[b]) else "draft probabilities"
            running[b].error = (
                f"the {what} for this request were not finite (NaN or inf) at output position "
                f"{len(running[b].output_ids)}; the request was ended, its neighbours were not affected"
            )
            log.warning("request %s: %s", running[b].req.id, running[b].error)
        logits = logits.masked_fill(bad.to(logits.device)[:, None, None], 0.0)
        if q is not None:
            prop = dataclasses.replace(prop, draft_probs=q.masked_fill(bad.to(q.device)[:, None, None], 1.0))
        return prop, logits

    def _verify_forward(self, running: list[RunningRequest], prop: Proposal):
        dev = self.model.info.device
        num_draft = prop.num_draft.cpu()  # [B]
        k = prop.max_k
        input_ids = torch.zeros(len(running), k + 1, dtype=torch.long)  # [B, K+1]
        input_ids[:, 0] = torch.tensor([r.token_ids[-1] for r in running])
        input_ids[:, 1:] = prop.draft_ids.cpu()
        lengths = torch.tensor([self.cache.lengths[r.slot] for r in running])  # [B]
        tree_mask, depths = None, num_draft.tolist()
        if prop.parents is None:
            positions = lengths[:, None] + torch.arange(k + 1)[None]  # [B, K+1]
        else:  # each node sees its ancestors; its position is the committed length + its depth
            tree_mask = torch.eye(k + 1, dtype=torch.bool).repeat(len(running), 1, 1)  # [B, K+1, K+1]
            positions = lengths[:, None].repeat(1, k + 1)  # [B, K+1]
            for b in range(len(running)):
                n = int(num_draft[b])
                par = prop.parents[b, :n].cpu()
                tree_mask[b, : n + 1, : n + 1] = tree_attention_mask(par)
                node_depths = tree_depths(par)  # [n+1]
                positions[b, : n + 1] += node_depths
                depths[b] = int(node_depths.max())
        ragged = bool((num_draft != k).any())
        out = self.model.forward(
            input_ids.to(dev),
            positions.to(dev),
            self.cache,
            [r.slot for r in running],
            num_new=(num_draft + 1).tolist() if ragged else None,
            tree_mask=None if tree_mask is None else tree_mask.to(dev),
            capture=self.drafter.needs_hidden,
        )
        return out, num_draft, depths

    def _verify_tree(
        self, running: list[RunningRequest], prop: Proposal, logits: torch.Tensor, num_draft: torch.Tensor
    ):
        """Per request: recursive rejection over siblings, then commit the accepted path's rows."""
        params = [r.req.params for r in running]
        target_probs = process_logits_batch(logits, params, self.vocab_size)  # [B, K+1, V]
        accepted, emitted, prop.accepted_nodes = [], [], []
        for b, r in enumerate(running):
            n = int(num_draft[b])
            tree = DraftTree(tokens=prop.draft_ids[b, :n].cpu(), parents=prop.parents[b, :n].cpu())
            q = None if prop.draft_probs is None else prop.draft_probs[b, :n].to(target_probs.device)
            if n == 0:  # nothing drafted: sample position t as plain decoding (and a chain) would
                u = r.sample_uniforms(len(r.output_ids), 1)
            else:  # exactly n + 1 uniforms per request, whatever its neighbours drafted
                u = torch.rand(n + 1, generator=r.generator)
            v = verify_tree(tree, target_probs[b, : n + 1], q, u.to(target_probs.device), iid=prop.tree_iid)
            kept = v.kept_rows.tolist()
            self.cache.commit(r.slot, len(kept), kept_rows=kept)
            accepted.append(v.num_accepted)
            emitted.append(v.emitted_ids.tolist())
            prop.accepted_nodes.append(v.accepted_nodes.tolist())
        return accepted, emitted

    def _verify(
        self, running: list[RunningRequest], prop: Proposal, logits: torch.Tensor, num_draft: torch.Tensor
    ):
        b_sz, k = len(running), prop.max_k
        params = [r.req.params for r in running]
        if all(p.greedy for p in params):
            return self._verify_greedy(prop, logits, num_draft)
        target_probs = process_logits_batch(logits, params, self.vocab_size)  # [B, K+1, V]
        keyed = self.verify_mode == "match" or prop.draft_probs is None
        uniforms = torch.zeros(b_sz, k + 1)  # [B, K+1]
        for b, r in enumerate(running):
            n, t0 = int(num_draft[b]), len(r.output_ids)
            if keyed:
                # Sample-then-match: column j samples the target's token at output position t0 + j.
                uniforms[b, : n + 1] = r.sample_uniforms(t0, n + 1)
            elif n == 0:
                # Nothing to verify: sample position t0 as plain decoding would.
                uniforms[b, k] = r.sample_uniforms(t0, 1)[0]
            else:
                # Chain rejection sampling: column j decides draft j, column K samples the
                # recovered / bonus token; exactly n + 1 uniforms from the request's generator.
                u = torch.rand(n + 1, generator=r.generator)
                uniforms[b, : n + 1] = u
                uniforms[b, k] = u[n]
        uniforms = uniforms.to(target_probs.device)
        draft_ids = prop.draft_ids.to(target_probs.device)
        nd = num_draft.to(target_probs.device)
        if keyed:
            verdict = verify_chain_match(draft_ids, target_probs, uniforms, nd)
        else:
            q = prop.draft_probs.to(target_probs.device)
            verdict = verify_chain(draft_ids, q, target_probs, uniforms, nd)
        accepted = verdict.num_accepted.tolist()
        emitted_all = verdict.emitted_ids.tolist()
        return accepted, [emitted_all[b][: accepted[b] + 1] for b in range(b_sz)]

    def _verify_greedy(self, prop: Proposal, logits: torch.Tensor, num_draft: torch.Tensor):
        """T = 0 for every request: the exact limit of rejection sampling, without the one-hot
        distributions (accept while draft == argmax; the argmax is the recovered/bonus token)."""
        target_ids = logits[..., : self.vocab_size].argmax(dim=-1).cpu()  # [B, K+1]
        k = prop.max_k
        valid = torch.arange(k)[None] < num_draft[:, None]  # [B, K]
        match = (prop.draft_ids.cpu() == target_ids[:, :k]) & valid
        accepted = match.long().cumprod(dim=1).sum(dim=1).tolist()
        ids = target_ids.tolist()
        return accepted, [ids[b][: accepted[b] + 1] for b in range(len(accepted))]

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
