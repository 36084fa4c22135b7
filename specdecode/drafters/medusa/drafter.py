"""Medusa drafting: all heads read one target state; chain or static tree, verified losslessly.

Contract:
- `MedusaDrafter(model, target, tree=None)` captures the target's final normed state
  (`needs_hidden = (-1,)`). The state of the row before each request's last committed token
  (the last prefill row, or the verify row whose target sample was the last emitted token)
  feeds every head: head k's candidates are guesses for the token k positions after that.
- Chain: the top-1 token of heads 1..K (point-mass drafts).
- Tree (`tree=StaticTree`, from `tree.tree_from_paths`): node with rank path (r_1..r_d) takes
  head d's r_d-th best token; the fixed shape is verified with tree attention, siblings as
  deterministic candidates (lossless at any temperature).
- `default_paths(num_nodes, depth)`: the `num_nodes` best rank paths under the score
  prod_i 0.6 / (r_i + 1) (acceptance falls with depth and rank), so prefixes are always in.
Legend: B requests, K heads, d width, Vd draft vocabulary.
"""

from __future__ import annotations

import heapq

import torch

from specdecode.drafter import Drafter, DraftRow, Proposal, empty_proposal
from specdecode.models.base import FINAL_NORM
from specdecode.tree import StaticTree
from specdecode.verify import Verdict


def default_paths(num_nodes: int = 16, depth: int = 4, topk: int = 4) -> list[tuple[int, ...]]:
    heap = [(-0.6 / (r + 1), (r,)) for r in range(topk)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < num_nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r in range(topk):
                heapq.heappush(heap, (neg * 0.6 / (r + 1), (*path, r)))
    return out


class MedusaDrafter(Drafter):
    name = "medusa"
    deterministic = True
    needs_hidden = (FINAL_NORM,)

    def __init__(self, model, target, tree: StaticTree | None = None, cost_per_token: float = 0.02):
        self.net = model.eval()
        self.vocab_size = target.vocab_size
        self.tree = tree
        self.cost_per_token = cost_per_token
        self.fingerprint = ""
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self._state: dict[int, torch.Tensor] = {}  # slot -> [d] state of the row before the last token

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        h = (hidden or {}).get(FINAL_NORM)
        if h is not None and h.shape[0]:
            self._state[slot] = h[-1].to(self.device, self.dtype)
        else:
            self._state.pop(slot, None)

    def stop(self, slot: int) -> None:
        self._state.pop(slot, None)

    @torch.no_grad()
    def _head_topk(self, states: torch.Tensor, k: int) -> torch.Tensor:
        """[B, d] -> [B, K, k] target ids of each head's k best draft-vocabulary tokens."""
        logits = self.net(states).float()  # [B, K, Vd]
        logits[..., self.net.d2t >= self.vocab_size] = float("-inf")
        return self.net.d2t[logits.topk(k, dim=-1).indices]

    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        idx = [b for b, k in enumerate(num_draft) if k > 0 and batch[b].slot in self._state]
        if not idx:
            return empty_proposal(len(batch))
        states = torch.stack([self._state[batch[b].slot] for b in idx])  # [B', d]
        heads = self.net.cfg.num_heads
        if self.tree is None:
            top = self._head_topk(states, 1)[:, :, 0].cpu()  # [B', K]
            k = min(heads, max(num_draft[b] for b in idx))
            ids = torch.zeros(len(batch), k, dtype=torch.long)
            num = torch.zeros(len(batch), dtype=torch.long)
            for i, b in enumerate(idx):
                n = min(num_draft[b], heads)
                ids[b, :n] = top[i, :n]
                num[b] = n
            return Proposal(draft_ids=ids, num_draft=num)
        tree = self.tree
        width = int(tree.ranks.max()) + 1
        top = self._head_topk(states, width).cpu()  # [B', K, width]
        n_nodes = tree.parents.shape[0]
        ids = torch.zeros(len(batch), n_nodes, dtype=torch.long)
        parents = tree.parents[None].repeat(len(batch), 1)
        num = torch.zeros(len(batch), dtype=torch.long)
        for i, b in enumerate(idx):
            # The static order is by depth, so the first n nodes always form a tree.
            n = min(num_draft[b], n_nodes)
            ids[b, :n] = top[i, tree.depths[:n] - 1, tree.ranks[:n]]
            num[b] = n
        return Proposal(draft_ids=ids, num_draft=num, parents=parents, tree_iid=False)

    def advance(self, batch: list[DraftRow], proposal: Proposal, verdicts: list[Verdict], target_out) -> None:
        h = target_out.hidden[FINAL_NORM]  # [B, N, d]
        for b, row in enumerate(batch):
            r = verdicts[b].kept_rows[-1]  # the block row of the last accepted token
            self._state[row.slot] = h[b, r].to(self.device, self.dtype)
