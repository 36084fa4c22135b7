"""The drafter interface every method implements, and the record that registers a method.

Contract:
- The decoding loop owns requests, the target and its cache; a drafter only proposes.
- `start(slot, prompt_ids, hidden)` is called when a request enters a slot, `stop(slot)` when it
  leaves. `hidden` maps each `needs_hidden` layer to the target's states for every prompt token
  but the last (`[P-1, d]`; that last token opens the first verify block), else it is empty.
- `prefill(slot, prompt_ids)`, called right after `start` when the request may draft at all:
  a drafter with a cache of its own runs the prompt through it here (prefill, as the target
  reads its prompt) instead of in its first `propose`, so that work is the request's prefill
  time and a round costs what a round costs; a request that never drafts (K 0, or a policy that
  never drafts on this machine) skips it, and `propose` still catches up whatever is left.
  `prompt_row(slot, prompt_ids)` is the `DraftRow` such work reads (slot and token ids).
- `propose(batch, num_draft)` returns a `Proposal` for the requests in `batch` (one row each, in
  order). `num_draft[b]` is an upper bound: a drafter may propose fewer (n-gram with no match).
  `draft_probs` is the *processed* distribution each draft token was sampled from (same
  temperature / top-k / top-p as the target), or None for deterministic (point-mass) drafts.
- `advance(batch, proposal, verdicts, target_out)` is called after verification with the
  proposal as drafted, one `verify.Verdict` per row (`num_accepted`; `kept_rows`: the verify-block
  rows committed to the cache, 0 first; `accepted_nodes` for trees) and the target's forward
  output for the verify block (hidden states of `needs_hidden` layers included), so stateful
  drafters can catch up. Nothing mutates a Proposal after it is made.
- `provides_confidences = True`: the proposal carries `extras["confidences"]` [B, K] (per-position
  acceptance estimates known before each draft was drawn) for the draft-length policy.
- `gather_features(hidden, layers, b, rows)` concatenates captured layers (for one request `b`
  and some rows) into one `[n, sum d]` tensor, or None when a layer was not captured.
- Everything a drafter draws at random comes from `DraftRow.generator`, per request, so a
  request's output never depends on the other requests in its batch.
- `Method` is one drafter package's record (names and default K, loader, training task, CLI
  options, whether it needs a checkpoint); `specdecode.drafters` registers them in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.config import SamplingParams


@dataclass
class DraftRow:
    """What a drafter may read about one request in the current step."""

    slot: int
    token_ids: list[int]  # prompt + committed output; the last one is not yet in the target cache
    params: SamplingParams
    generator: torch.Generator


def prompt_row(slot: int, prompt_ids: list[int]) -> DraftRow:
    """The request at `start`: its prompt as the committed tokens (for the prompt's catch-up)."""
    return DraftRow(slot, list(prompt_ids), SamplingParams(), torch.Generator())


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, K] long, rows right-padded with 0 beyond num_draft
    num_draft: torch.Tensor  # [B] long (host)
    draft_probs: torch.Tensor | None = None  # [B, K, V] fp32 processed q; None = point mass
    # With a reduced draft vocabulary, draft_probs may be [B, K, Vd] over these target ids (q is 0
    # elsewhere): the verifier reads it so (`dense_probs` scatters it for the tensor path).
    draft_vocab: torch.Tensor | None = None  # [Vd] long
    # A tree instead of a chain: node k's parent (-1 = the last committed token), parents before
    # children; with draft_probs, row k holds the q node k was drawn from (q at its parent).
    parents: torch.Tensor | None = None  # [B, K] long
    tree_iid: bool = False  # True: siblings drawn i.i.d. from q; False: chosen deterministically
    extras: dict = field(default_factory=dict)  # drafter-private data carried to advance()
    # Seconds of propose() spent catching up on committed context (work any later round would
    # do too), which online cost models leave out of the round's own cost.
    catch_up_s: float = 0.0

    @property
    def max_k(self) -> int:
        return self.draft_ids.shape[1]

    def dense_probs(self, vocab_rows: int) -> torch.Tensor | None:
        """draft_probs over the target's vocabulary rows, [B, K, vocab_rows] (None: point masses)."""
        q = self.draft_probs
        if q is None or self.draft_vocab is None:
            return q
        full = torch.zeros(*q.shape[:-1], vocab_rows, dtype=q.dtype, device=q.device)
        return full.index_copy_(-1, self.draft_vocab.to(q.device), q)


def empty_proposal(batch_size: int, device: torch.device | str = "cpu") -> Proposal:
    return Proposal(
        draft_ids=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
        num_draft=torch.zeros(batch_size, dtype=torch.long),
    )


class Drafter:
    """Base class: a drafter that proposes nothing (the `ar` baseline)."""

    name: str = "base"
    needs_hidden: tuple[int, ...] = ()  # target decoder layers captured during verification
    # Relative cost of one draft token vs one target step; the adaptive policy uses it.
    cost_per_token: float = 0.0
    cost_points: tuple[int, ...] = ()  # K besides 1 and K_max where a round's cost bends (timed)
    sampled_k_max: int | None = None  # most drafts a round gives a request at T > 0 (None: K)
    deterministic: bool = True  # True: point-mass drafts (draft_probs is None)
    provides_confidences: bool = False  # proposals carry extras["confidences"] [B, K]
    model = None  # a drafter that is a CausalLM of its own (the draft model): its step is timed

    def setup(self, num_slots: int, max_len: int) -> None:
        """Called by the loop before requests arrive: size per-slot state."""

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        pass

    def prefill(self, slot: int, prompt_ids: list[int]) -> None:
        """Read the prompt into the drafter's own state now (default: nothing to read)."""

    def stop(self, slot: int) -> None:
        pass

    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        return empty_proposal(len(batch))

    def advance(self, batch: list[DraftRow], proposal: Proposal, verdicts: list, target_out) -> None:
        """verdicts: one `verify.Verdict` per row of `batch`."""


def gather_features(hidden: dict, layers, b: int | None = None, rows=None) -> torch.Tensor | None:
    """Captured states of `layers` side by side: `hidden[layer]` is [n, d] (b None) or [B, n, d]."""
    parts = []
    for layer in layers:
        h = hidden[layer]
        if h is None:
            return None
        h = h if b is None else h[b]
        parts.append(h if rows is None else h[rows])
    return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class Method:
    """What the rest of the package needs to know about one drafter family.

    `variants` maps each `--method` name the family serves to its default K (e.g. eagle: 4,
    eagle-tree: 16). `load(variant, target, spec, dtype=, device=, **options)` returns a ready
    `Drafter`, `spec` being `--drafter` (a model, or None for the default); for a family with a
    `checkpoint` kind the registry passes the checkpoint directory (`--drafter DIR`, else the
    one shipped for the target). `needs_drafter=False`: the method takes no `--drafter` at all.
    `task` names the training task (`specdecode.training.methods.<task>`), None if untrainable;
    `train_options` are that task's settings with their defaults (`specdecode train` flags).
    `options` are the drafter settings only this family takes (CLI flags `--confidence-threshold`
    ...). `checkpoint` is the kind of checkpoint it loads (`config.json` "method"), None if it
    needs none.
    """

    name: str
    variants: dict[str, int]
    load: Callable[..., Drafter]
    task: str | None = None
    train_options: dict[str, Any] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    checkpoint: str | None = None
    needs_drafter: bool = True
    summary: str = ""
