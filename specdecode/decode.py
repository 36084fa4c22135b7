"""The speculative decoding loop: draft, verify in one target forward, commit, emit.

Contract:
- `SpeculativeDecoder(target, drafter, policy)` decodes `GenerationRequest`s. `stream()` yields
  a `StreamEvent` per request per step (new text, new token ids, and the final
  `GenerationResult` once it finishes); `generate()` returns the results in request order.
- Up to `max_batch` requests run together; a finished request frees its slot and the next
  waiting one is prefilled into it between steps. Each step is one target forward over
  `[last token, drafts...]` for every running request (ragged K per request).
- The target cache holds every committed token except each request's last one, which opens the
  next verify block; so a step with no drafts is exactly plain autoregressive decoding (`ar`).
- Output distribution is exactly the target's (verification is lossless), and at T = 0 the
  tokens equal greedy decoding. All randomness of a request comes from its own generator
  seeded with `request.seed`: a request decodes the same alone or in any batch.
- Stop conditions (EOS, stop strings, max_new_tokens) are applied token by token inside an
  accepted block; tokens after the stop are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams
from specdecode.drafters.base import Drafter, DraftRow, Proposal, empty_proposal
from specdecode.errors import SpecDecodeError
from specdecode.policy import FixedK, PolicyState
from specdecode.sampling import process_logits_batch
from specdecode.tree import DraftTree, tree_attention_mask, tree_depths
from specdecode.verify import verify_chain, verify_chain_match, verify_tree

PREFILL_CHUNK = 512
VERIFY_MODES = ("rejection", "match")


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


@dataclass
class _Running:
    """A request in a slot."""

    req: GenerationRequest
    slot: int
    generator: torch.Generator
    token_ids: list[int]  # prompt + output; the last one is not yet in the target cache
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

    def row(self) -> DraftRow:
        return DraftRow(self.slot, self.token_ids, self.req.params, self.generator)


class SpeculativeDecoder:
    def __init__(
        self,
        target,  # specdecode.models.loader.LoadedModel
        drafter: Drafter,
        policy=None,
        max_batch: int = 8,
        verify_mode: str = "rejection",
    ):
        if verify_mode not in VERIFY_MODES:
            raise SpecDecodeError(
                f"unknown verify mode {verify_mode!r}; choose one of: {', '.join(VERIFY_MODES)}"
            )
        if max_batch < 1:
            raise SpecDecodeError(f"max_batch must be >= 1, got {max_batch}")
        self.target, self.model, self.tokenizer = target, target.model, target.tokenizer
        self.drafter = drafter
        self.policy = policy if policy is not None else FixedK(0)
        self.max_batch, self.verify_mode = max_batch, verify_mode
        self.vocab_size = target.vocab_size
        self.eos_ids = set(target.eos_token_ids)
        self.cache, self._cache_shape = None, (0, 0)
        self.draft_time = self.verify_time = 0.0

    # ---- set-up -------------------------------------------------------------------------
    def _check(self, req: GenerationRequest) -> None:
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

    def _ensure_cache(self, requests: list[GenerationRequest]) -> None:
        k_max = getattr(self.policy, "k_max", 0)
        need_len = max(len(r.prompt_ids) + r.max_new_tokens + k_max + 2 for r in requests)
        need_len = min(need_len, self.model.info.max_position + k_max + 2)
        slots = min(self.max_batch, len(requests))
        if slots > self._cache_shape[0] or need_len > self._cache_shape[1]:
            self._cache_shape = (max(slots, self._cache_shape[0]), max(need_len, self._cache_shape[1]))
            self.cache = self.model.new_cache(*self._cache_shape)
            self.drafter.setup(*self._cache_shape)

    @torch.inference_mode()
    def _admit(self, req: GenerationRequest, slot: int) -> _Running:
        t0 = time.perf_counter()
        self.cache.reset(slot)
        prompt = req.prompt_ids
        dev = self.model.info.device
        capture = self.drafter.needs_hidden
        parts: dict[int, list[torch.Tensor]] = {i: [] for i in capture}
        for start in range(0, len(prompt) - 1, PREFILL_CHUNK):
            chunk = prompt[start : min(start + PREFILL_CHUNK, len(prompt) - 1)]
            ids = torch.tensor([chunk], dtype=torch.long, device=dev)  # [1, N]
            pos = torch.arange(start, start + len(chunk), device=dev)[None]  # [1, N]
            out = self.model.forward(ids, pos, self.cache, [slot], logits=False, capture=capture)
            self.cache.commit(slot, len(chunk))
            for i in capture:
                parts[i].append(out.hidden[i][0])  # [N, d]
        hidden = {i: torch.cat(p) if p else None for i, p in parts.items()}  # layer -> [P-1, d]
        self.drafter.start(slot, list(prompt), hidden)
        gen = torch.Generator().manual_seed(req.seed)
        run = _Running(req, slot, gen, list(prompt), prefill_time=time.perf_counter() - t0)
        run.t_start = time.perf_counter()
        return run

    # ---- one step -----------------------------------------------------------------------
    def _budget(self, r: _Running, k: int) -> int:
        # Never draft past max_new_tokens: the last emitted token is always the target's.
        return max(0, min(k, r.req.max_new_tokens - len(r.output_ids) - 1))

    @torch.inference_mode()
    def _step(self, running: list[_Running]) -> list[list[int]]:
        """One draft -> verify -> commit round; returns the emitted token ids per request."""
        rows = [r.row() for r in running]
        # 1. Draft lengths and drafts.
        ks = [
            self._budget(r, k)
            for r, k in zip(running, self.policy.choose([r.policy_state for r in running]), strict=True)
        ]
        t0 = time.perf_counter()
        prop = self.drafter.propose(rows, ks) if any(ks) else empty_proposal(len(rows))
        t1 = time.perf_counter()
        # 2. One target forward over [last token, drafts...] per request.
        out, num_draft, depths = self._verify_forward(running, prop)
        # 3. Verification (lossless), then commit the kept rows.
        if prop.parents is None:
            accepted, emitted = self._verify(running, prop, out.logits, num_draft)
            for r, n_acc in zip(running, accepted, strict=True):
                self.cache.commit(r.slot, n_acc + 1)
        else:
            accepted, emitted = self._verify_tree(running, prop, out.logits, num_draft)
        self.drafter.advance(rows, prop, accepted, out)
        t2 = time.perf_counter()
        self.draft_time += t1 - t0
        self.verify_time += t2 - t1
        # 4. Statistics for the policy and the report (per depth: a chain's depth is its length).
        for b, r in enumerate(running):
            n, n_acc = int(depths[b]), accepted[b]
            self.policy.observe(r.policy_state, n, n_acc)
            r.num_steps += 1
            r.num_emitted += n_acc + 1
            for j in range(n):
                if j >= len(r.reached):
                    r.reached.append(0)
                    r.accepted.append(0)
                r.reached[j] += j <= n_acc
                r.accepted[j] += j < n_acc
        return emitted

    def _verify_forward(self, running: list[_Running], prop: Proposal):
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
        self, running: list[_Running], prop: Proposal, logits: torch.Tensor, num_draft: torch.Tensor
    ):
        """Per request: recursive rejection over siblings, then commit the accepted path's rows."""
        params = [r.req.params for r in running]
        target_probs = process_logits_batch(logits, params, self.vocab_size)  # [B, K+1, V]
        accepted, emitted, prop.accepted_nodes = [], [], []
        for b, r in enumerate(running):
            n = int(num_draft[b])
            tree = DraftTree(tokens=prop.draft_ids[b, :n].cpu(), parents=prop.parents[b, :n].cpu())
            q = None if prop.draft_probs is None else prop.draft_probs[b, :n].to(target_probs.device)
            u = torch.rand(n + 1, generator=r.generator)  # exactly n + 1 uniforms per request
            v = verify_tree(tree, target_probs[b, : n + 1], q, u.to(target_probs.device), iid=prop.tree_iid)
            kept = v.kept_rows.tolist()
            self.cache.commit(r.slot, len(kept), kept_rows=kept)
            accepted.append(v.num_accepted)
            emitted.append(v.emitted_ids.tolist())
            prop.accepted_nodes.append(v.accepted_nodes.tolist())
        return accepted, emitted

    def _verify(self, running: list[_Running], prop: Proposal, logits: torch.Tensor, num_draft: torch.Tensor):
        b_sz, k = len(running), prop.max_k
        params = [r.req.params for r in running]
        if all(p.greedy for p in params):
            return self._verify_greedy(prop, logits, num_draft)
        target_probs = process_logits_batch(logits, params, self.vocab_size)  # [B, K+1, V]
        # Each request draws exactly num_draft + 1 uniforms from its own generator. Chain
        # verification reads column K for the recovered / bonus token, sample-then-match reads
        # column n (the row after the last draft): both get the request's last uniform.
        uniforms = torch.zeros(b_sz, k + 1)  # [B, K+1]
        for b, r in enumerate(running):
            n = int(num_draft[b])
            u = torch.rand(n + 1, generator=r.generator)
            uniforms[b, : n + 1] = u
            uniforms[b, k] = u[n]
        uniforms = uniforms.to(target_probs.device)
        draft_ids = prop.draft_ids.to(target_probs.device)
        nd = num_draft.to(target_probs.device)
        if self.verify_mode == "match":
            verdict = verify_chain_match(draft_ids, target_probs, uniforms, nd)
        else:
            q = prop.draft_probs.to(target_probs.device) if prop.draft_probs is not None else None
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

    # ---- emission and stop conditions ---------------------------------------------------
    def _emit(self, r: _Running, new_ids: list[int]) -> StreamEvent:
        taken: list[int] = []
        for tok in new_ids:
            if tok in self.eos_ids and not r.req.ignore_eos:
                r.finish_reason = "stop"
                break
            taken.append(tok)
            if len(r.output_ids) + len(taken) >= r.req.max_new_tokens:
                r.finish_reason = "length"
                break
        r.output_ids.extend(taken)
        r.token_ids.extend(taken)
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        hold = 0
        for s in r.req.stop:
            cut = text.find(s, max(0, len(r.sent_text) - len(s)))
            if cut >= 0:
                text, r.finish_reason = text[:cut], "stop"
                r.output_ids = self._trim_ids(r.output_ids, text)
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
            event.result = self._result(r, text)
        return event

    def _trim_ids(self, ids: list[int], text: str) -> list[int]:
        """Shortest prefix of ids whose text covers `text` (used when a stop string cuts it)."""
        for n in range(len(ids) + 1):
            if len(self.tokenizer.decode(ids[:n], skip_special_tokens=True)) >= len(text):
                return ids[:n]
        return ids

    def _result(self, r: _Running, text: str) -> GenerationResult:
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

    # ---- public API ---------------------------------------------------------------------
    def stream(self, requests: Iterable[GenerationRequest]) -> Iterator[StreamEvent]:
        waiting = list(requests)
        if not waiting:
            return
        ids = [r.id for r in waiting]
        if len(set(ids)) != len(ids):
            raise SpecDecodeError("request ids must be unique within one call")
        for req in waiting:
            self._check(req)
        self._ensure_cache(waiting)
        waiting.reverse()
        free = list(range(self._cache_shape[0] - 1, -1, -1))
        running: list[_Running] = []
        try:
            while waiting or running:
                while waiting and free and len(running) < self.max_batch:
                    running.append(self._admit(waiting.pop(), free.pop()))
                emitted = self._step(running)
                still = []
                for r, new_ids in zip(running, emitted, strict=True):
                    event = self._emit(r, new_ids)
                    if event.text or event.token_ids or event.result:
                        yield event
                    if r.finish_reason is None:
                        still.append(r)
                    else:
                        self.drafter.stop(r.slot)
                        free.append(r.slot)
                running = still
        finally:
            for r in running:  # the consumer stopped early: release the slots
                self.drafter.stop(r.slot)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = {}
        for event in self.stream(requests):
            if event.result is not None:
                results[event.request_id] = event.result
        return [results[r.id] for r in requests]
