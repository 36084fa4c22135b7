"""The drafter interface every method implements.

Contract:
- The decoding loop owns requests, the target and its cache; a drafter only proposes.
- `start(slot, prompt_ids, hidden)` is called when a request enters a slot, `stop(slot)` when it
  leaves. `hidden` maps each `needs_hidden` layer to the target's states for every prompt token
  but the last (`[P-1, d]`; that last token opens the first verify block), else it is empty.
- `propose(batch, num_draft)` returns a `Proposal` for the requests in `batch` (one row each, in
  order). `num_draft[b]` is an upper bound: a drafter may propose fewer (n-gram with no match).
  `draft_probs` is the *processed* distribution each draft token was sampled from (same
  temperature / top-k / top-p as the target), or None for deterministic (point-mass) drafts.
- `advance(batch, proposal, num_accepted, target_out)` is called after verification with the
  number of drafts accepted per row and the target's forward output for the verify block
  (hidden states of `needs_hidden` layers included), so stateful drafters can catch up.
- `gather_features(hidden, layers, b, rows)` concatenates captured layers (for one request `b`
  and some rows) into one `[n, sum d]` tensor, or None when a layer was not captured.
- Everything a drafter draws at random comes from `DraftRow.generator`, per request, so a
  request's output never depends on the other requests in its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams


@dataclass
class DraftRow:
    """What a drafter may read about one request in the current step."""

    slot: int
    token_ids: list[int]  # prompt + committed output; the last one is not yet in the target cache
    params: SamplingParams
    generator: torch.Generator


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, K] long, rows right-padded with 0 beyond num_draft
    num_draft: torch.Tensor  # [B] long (host)
    draft_probs: torch.Tensor | None = None  # [B, K, V] fp32 processed q; None = point mass
    # A tree instead of a chain: node k's parent (-1 = the last committed token), parents before
    # children; with draft_probs, row k holds the q node k was drawn from (q at its parent).
    parents: torch.Tensor | None = None  # [B, K] long
    tree_iid: bool = False  # True: siblings drawn i.i.d. from q; False: chosen deterministically
    extras: dict = field(default_factory=dict)  # drafter-private data carried to advance()
    # Set by the loop after verification for tree proposals: accepted node indices per row.
    accepted_nodes: list[list[int]] | None = None
    # Seconds of propose() spent catching up on committed context (work any later round would
    # do too), which online cost models leave out of the round's own cost.
    catch_up_s: float = 0.0

    @property
    def max_k(self) -> int:
        return self.draft_ids.shape[1]


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
    deterministic: bool = True  # True: point-mass drafts (draft_probs is None)

    def setup(self, num_slots: int, max_len: int) -> None:
        """Called by the loop before requests arrive: size per-slot state."""

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        pass

    def stop(self, slot: int) -> None:
        pass

    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        return empty_proposal(len(batch))

    def advance(self, batch: list[DraftRow], proposal: Proposal, num_accepted: list[int], target_out) -> None:
        pass


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
