"""One speculative step for a batch of running requests: propose -> verify forward -> verify ->
commit -> advance.

Contract:
- `speculate(batch, target, cache, drafter, policy, verify_mode, stats, riders)` runs one step
  for every request in `batch` (running `request.RunningRequest`s, rows in that order) and
  returns one `verify.Verdict` per request, and the outputs of `riders`: forward segments of
  other slots (prompt chunks) packed into the verify forward (`models.base.forward_packed`),
  which the caller commits. The step's figures go to `stats`. The target cache holds every
  committed token except each request's last one, which opens the verify block
  `[last token, drafts...]`; a step with no drafts is exactly plain autoregressive decoding.
- K per request comes from the policy (`choose`, or `bounds` for a drafter that reports
  confidences, which may then shorten its chains with `truncate`); a request never drafts past
  its `max_new_tokens` (the last emitted token is always the target's).
- Verification is lossless (`verify.verify_step`); the verdict's `kept_rows` are committed to the
  cache, and the drafter catches up with `advance(rows, proposal, verdicts, target_out)`.
- A row whose target logits or draft probabilities are not finite gets `request.error` set and
  harmless numbers, so its neighbours are verified exactly as without it; the caller ends it.
- Per-request statistics (steps, emitted tokens, acceptance per draft position) and the
  policy's observations are updated here, once per step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.drafter import Drafter, Proposal, empty_proposal
from specdecode.models.base import ForwardOutput, Segment, forward_packed
from specdecode.models.kv_cache import KVCache
from specdecode.policy import DraftPolicy
from specdecode.request import RunningRequest
from specdecode.sampling import finite_rows
from specdecode.tree import tree_rows
from specdecode.verify import Verdict, verify_step

log = logging.getLogger("specdecode.step")


@dataclass
class StepStats:
    """What the last step did (read by the serving engine's metrics)."""

    num_rows: int = 0  # requests decoded
    block: int = 0  # tokens per request in the verify forward (rows are padded to it)
    num_draft: int = 0  # draft tokens verified
    num_accepted: int = 0
    num_emitted: int = 0  # tokens emitted, before stop truncation
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0


@torch.inference_mode()
def speculate(
    batch: list[RunningRequest],
    model,  # models.base.CausalLM
    cache: KVCache,
    drafter: Drafter,
    policy: DraftPolicy,
    vocab_size: int,
    verify_mode: str = "block",
    stats: StepStats | None = None,
    riders: Sequence[Segment] = (),
) -> tuple[list[Verdict], list[ForwardOutput]]:
    stats = stats if stats is not None else StepStats()
    rows = [r.row() for r in batch]
    t0 = time.perf_counter()
    ks = draft_lengths(batch, policy, drafter)  # 1. propose
    proposal = drafter.propose(rows, ks) if any(ks) else empty_proposal(len(rows))
    verified = truncate(batch, proposal, policy)
    t1 = time.perf_counter()
    out, rider_outs = verify_forward(model, cache, batch, verified, drafter.needs_hidden, riders)  # 2.
    verified, logits = isolate_failures(batch, verified, out.logits, vocab_size)
    verdicts = verify_step(  # 3. verify (lossless)
        verified,
        logits,
        [r.req.params for r in batch],
        batch,
        [len(r.output_ids) for r in batch],
        vocab_size,
        verify_mode,
    )
    for r, v in zip(batch, verdicts, strict=True):  # 4. commit
        cache.commit(r.slot, len(v.kept_rows), kept_rows=v.kept_rows)
    t_adv = time.perf_counter()
    drafter.advance(rows, proposal, verdicts, out)  # 5. advance
    t2 = time.perf_counter()
    # A round's own cost leaves out catching up on context and advance(), paid every step.
    context = max(len(r.token_ids) for r in batch)
    draft_s = max(t1 - t0 - proposal.catch_up_s, 0.0)
    policy.observe_step(len(batch), verified.max_k + 1, context, proposal.max_k, draft_s, t_adv - t1)
    record(batch, verdicts, policy, stats)
    stats.num_rows, stats.block = len(batch), verified.max_k + 1
    stats.draft_s, stats.verify_s = t1 - t0, t2 - t1
    return verdicts, rider_outs


def draft_lengths(batch: list[RunningRequest], policy: DraftPolicy, drafter: Drafter) -> list[int]:
    """K per request from the policy, capped so no request drafts past max_new_tokens."""
    states = [r.policy_state for r in batch]
    for r, st in zip(batch, states, strict=True):
        st.context_len = len(r.token_ids)
        st.room = r.room()
    ks = policy.bounds(states) if drafter.provides_confidences else policy.choose(states)
    return [max(0, min(k, r.room())) for r, k in zip(batch, ks, strict=True)]


def truncate(batch: list[RunningRequest], proposal: Proposal, policy: DraftPolicy) -> Proposal:
    """The chains the policy keeps, where the drafter reported per-position confidences."""
    conf = proposal.extras.get("confidences")  # [B, K]
    if conf is None or proposal.parents is not None:
        return proposal
    nd = proposal.num_draft.cpu()
    ks = policy.truncate([r.policy_state for r in batch], conf, nd.tolist())
    num = torch.minimum(nd, torch.tensor(ks, dtype=torch.long))
    k = int(num.max()) if len(num) else 0
    q = None if proposal.draft_probs is None else proposal.draft_probs[:, :k]
    return dataclasses.replace(proposal, draft_ids=proposal.draft_ids[:, :k], num_draft=num, draft_probs=q)


def verify_forward(
    model,
    cache: KVCache,
    batch: list[RunningRequest],
    proposal: Proposal,
    capture,
    riders: Sequence[Segment] = (),
) -> tuple[ForwardOutput, list[ForwardOutput]]:
    """One target forward over [last token, drafts...] per request (a tree's nodes see their
    ancestors, at position committed length + depth), with the riders' segments packed in."""
    dev = model.info.device
    num_draft = proposal.num_draft.cpu()  # [B]
    k = proposal.max_k
    input_ids = torch.zeros(len(batch), k + 1, dtype=torch.long)  # [B, K+1]
    input_ids[:, 0] = torch.tensor([r.token_ids[-1] for r in batch])
    input_ids[:, 1:] = proposal.draft_ids.cpu()
    lengths = torch.tensor([cache.lengths[r.slot] for r in batch])  # [B]
    tree_mask = None
    if proposal.parents is None:
        positions = lengths[:, None] + torch.arange(k + 1)[None]  # [B, K+1]
    else:
        tree_mask = torch.eye(k + 1, dtype=torch.bool).repeat(len(batch), 1, 1)  # [B, K+1, K+1]
        positions = lengths[:, None].repeat(1, k + 1)  # [B, K+1]
        for b in range(len(batch)):
            n = int(num_draft[b])
            par = proposal.parents[b, :n].cpu()
            mask, depths = tree_rows(par)  # [n + 1, n + 1], [n + 1]
            tree_mask[b, : n + 1, : n + 1] = mask
            positions[b, : n + 1] += depths
    ragged = bool((num_draft != k).any())
    main = Segment(
        input_ids.to(dev),
        positions.to(dev),
        [r.slot for r in batch],
        num_new=(num_draft + 1).tolist() if ragged else None,
        tree_mask=None if tree_mask is None else tree_mask.to(dev),
        capture=capture,
    )
    outs = forward_packed(model, cache, [main, *riders])
    return outs[0], outs[1:]


def isolate_failures(batch: list[RunningRequest], proposal: Proposal, logits: torch.Tensor, vocab_size: int):
    """Mark rows with non-finite target logits or draft probabilities as failed, and give them
    harmless numbers so the batch's verification runs on (their output is discarded)."""
    ok_p = finite_rows(logits[..., :vocab_size])  # [B]
    q = proposal.draft_probs  # [B, K, V] or None
    ok_q = torch.ones_like(ok_p)  # [B]
    if q is not None and q.shape[1] > 0:
        ok_q = torch.isfinite(q).flatten(1).all(dim=1).to(ok_p.device)
    ok = ok_p & ok_q
    if bool(ok.all()):
        return proposal, logits
    bad = ~ok  # [B]
    for b in bad.nonzero().flatten().tolist():
        what = "target logits" if not bool(ok_p[b]) else "draft probabilities"
        batch[b].error = (
            f"the {what} for this request were not finite (NaN or inf) at output position "
            f"{len(batch[b].output_ids)}; the request was ended, its neighbours were not affected"
        )
        log.warning("request %s: %s", batch[b].req.id, batch[b].error)
    logits = logits.masked_fill(bad.to(logits.device)[:, None, None], 0.0)
    if q is not None:
        proposal = dataclasses.replace(
            proposal, draft_probs=q.masked_fill(bad.to(q.device)[:, None, None], 1.0)
        )
    return proposal, logits


def record(
    batch: list[RunningRequest], verdicts: list[Verdict], policy: DraftPolicy, stats: StepStats
) -> None:
    """Per-request and per-step statistics, and the policy's observations (a chain's depth is
    its length; a tree's, its deepest path)."""
    for r, v in zip(batch, verdicts, strict=True):
        n, n_acc = v.depth, v.num_accepted
        policy.observe(r.policy_state, n, n_acc)
        stats.num_draft += v.num_draft
        stats.num_accepted += n_acc
        stats.num_emitted += n_acc + 1
        r.num_steps += 1
        r.num_emitted += n_acc + 1
        r.num_drafted += v.num_draft
        for j in range(n):
            if j >= len(r.reached):
                r.reached.append(0)
                r.accepted.append(0)
            r.reached[j] += j <= n_acc
            r.accepted[j] += j < n_acc
