"""DSpark drafting: one backbone forward, then a left-to-right pass of the light Markov head.

Contract:
- `DSparkDrafter(net, target, confidence_threshold=None, threshold_on="survival")` extends
  `DFlashDrafter` (same context cache and block forward; all block slots are drafts). For slot
  k = 1..K in order: c_k = sigmoid(conf([h_k ; W1[x_{k-1}]]) / sts_temperature[k] + sts_bias[k]) (x_0 = the
  anchor), then x_k is sampled from q_k = process(U_k + W2(W1[x_{k-1}])) with the request's
  generator; q_k, the corrected distribution, is what rejection sampling uses. The pass runs
  over the Vd draft ids (a drafted token is its own Markov input); q goes to the verifier in
  the draft vocabulary (`Proposal.draft_vocab`, DFlashDrafter.propose). W2(W1[x]) is read from
  `DSpark.markov_table()` (one row gathered per slot, in the network's format) when the table
  fits `MARKOV_TABLE_BYTES`, else computed per slot. With every request greedy and no
  threshold, the pass over a CPU table is one compiled call (`markov_argmax`: the same fp32
  sums and first-maximum argmax as the per-slot loop, so the same drafts).
- Inference reads the confidence head as `DSpark.confidence_tables()` (one product for all
  slots' state parts, one table entry per slot for the previous token's part), per slot only
  when a threshold needs it, else for all slots after the pass. When every request of the batch
  is greedy, x_k is the argmax of the corrected logits and the proposal carries point masses
  (what processing at temperature 0 gives), without the per-slot processing.
- Confidences go to `Proposal.extras["confidences"]` ([B, K], c_k per draft) for the serving
  scheduler (`provides_confidences`).
- Tree (`tree=MarkovTree(topk, lookup)`, greedy rounds): the Markov head makes every slot's
  distribution a function of the token before it, so one backbone forward gives a whole tree:
  node x at depth k has the children top-`topk` of log q_{k+1}(. | x) = log_softmax(U_{k+1} +
  W2(W1[x])), and nodes join best first by cumulative log q (`markov_tree`) up to the round's K
  nodes, at most `block_size` deep. With `lookup`, prompt lookup's continuation joins by its
  score (`ngram.lookup_prefix`, `tree.join_by_score`). Siblings are chosen deterministically, so
  the loop verifies point-mass candidates; a round where a request samples (T > 0) drafts the
  chain instead (at most `block_size` drafts). Tree rounds carry no confidences (the adaptive
  policy picks K from measured acceptance).
- Per-request truncation: with `confidence_threshold`, a request stops drafting at the first k
  whose c_k ("confidence") or prefix survival a_k = prod_{i<=k} c_i ("survival") is below the
  threshold. The decision for slot k reads only c_k, which depends on x_{k-1} but never on x_k,
  so the output distribution stays the target's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.drafter import Proposal, empty_proposal
from specdecode.drafters.dflash.drafter import DFlashDrafter
from specdecode.drafters.dflash.model import t2d_table
from specdecode.drafters.dspark.model import DSpark
from specdecode.drafters.layers import DraftVocab
from specdecode.drafters.ngram import TREE_DEPTH, lookup_prefix
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.sampling import plain_temperature, sample
from specdecode.tree import join_by_score

THRESHOLD_ON = ("survival", "confidence")
# The Markov table trades memory for the per-slot product: (Vd + 1) x Vd values (134 MB in bf16,
# 268 MB in fp32 for the default Vd 8192); larger draft vocabularies keep the product.
MARKOV_TABLE_BYTES = 300 * 2**20


@dataclass(frozen=True)
class MarkovTree:
    topk: int = 4  # children ranked per expanded node
    lookup: bool = False  # prompt lookup's continuation joins the tree by its score


def markov_tree(
    U: torch.Tensor,  # [Bk, Vd] backbone logits of one request's block
    correction,  # draft id [1] -> [1, Vd]: W2(W1[x]), the Markov head's term
    vocab: DraftVocab,
    prev: int,  # draft id of the anchor (Vd: outside the draft vocabulary)
    budget: int,
    topk: int,
) -> tuple[list[int], list[int], list[float], list[int]]:
    """The `budget` best nodes of the Markov tree by cumulative log q, best first (so parents
    before children): (draft ids, parents (-1: the anchor), cumulative log q, depths). A node at
    depth k (1..Bk) is drafted at slot k - 1; its children rank the top-`topk` of
    log_softmax(U[k] + correction(node)). Ties go to the shallower node, then the earlier push."""
    toks: list[int] = []
    pars: list[int] = []
    scores: list[float] = []
    depths: list[int] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, depth, push order, parent, draft id)
    order = itertools.count()

    def push_children(node: int, depth: int, tok: int, score: float) -> None:
        bias = correction(torch.tensor([tok], device=U.device))[0].to(U.dtype)  # [Vd]
        lp = vocab.log_probs(U[depth] + bias)  # [Vd]
        top = lp.topk(min(topk, lp.shape[-1]))
        for s, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            heapq.heappush(heap, (-(score + s), depth + 1, next(order), node, t))

    push_children(-1, 0, prev, 0.0)
    while heap and len(toks) < budget:
        neg, depth, _, parent, tok = heapq.heappop(heap)
        toks.append(tok)
        pars.append(parent)
        scores.append(-neg)
        depths.append(depth)
        if depth < U.shape[0] and len(toks) < budget:
            push_children(len(toks) - 1, depth, tok, -neg)
    return toks, pars, scores, depths


class DSparkDrafter(DFlashDrafter):
    name = "dspark"
    provides_confidences = True

    def __init__(
        self,
        net: DSpark,
        target,
        confidence_threshold: float | None = None,
        threshold_on: str = "survival",
        cost_per_token: float = 0.02,
        tree: MarkovTree | None = None,
    ):
        super().__init__(net, target, cost_per_token)
        self.tree = tree
        if tree is not None:  # tree rounds: K from measured acceptance; sampled rounds: one block
            if confidence_threshold is not None:
                raise SpecDecodeError("--confidence-threshold truncates chains; a dspark tree takes none")
            self.provides_confidences = False
            self.sampled_k_max = net.cfg.num_drafts
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise SpecDecodeError(f"--confidence-threshold must be in [0, 1], got {confidence_threshold}")
        if threshold_on not in THRESHOLD_ON:
            raise SpecDecodeError(f"threshold_on must be one of {THRESHOLD_ON}, got {threshold_on!r}")
        self.threshold, self.threshold_on = confidence_threshold, threshold_on
        self.t2d = t2d_table(net.d2t, self.vocab_rows).to(self.device)  # [V]
        self.conf_w, self.conf_row = (t.to(self.device) for t in net.confidence_tables())  # [d], [Vd + 1]
        dtype = net.W2.weight.dtype
        Vd = net.cfg.draft_vocab_size
        fits = (Vd + 1) * Vd * dtype.itemsize <= MARKOV_TABLE_BYTES
        self.markov = net.markov_table().to(self.device, dtype) if fits else None  # [Vd + 1, Vd]

    def _correction(self, prev: torch.Tensor) -> torch.Tensor:  # [n] draft ids -> [n, Vd]
        if self.markov is not None:
            return self.markov[prev]
        return self.net.W2(self.net.W1(prev))

    @torch.no_grad()
    def propose(self, batch, num_draft: list[int]) -> Proposal:
        idx = [b for b, k in enumerate(num_draft) if k > 0]
        if self.tree is None or not all(batch[b].params.greedy for b in idx):
            return super().propose(batch, num_draft)  # the chain (a tree's sampled rounds too)
        t0 = time.perf_counter()
        self._catch_up([batch[b].slot for b in idx])
        catch_up_s = time.perf_counter() - t0
        if not idx:
            return empty_proposal(len(batch))
        U = self._logits(self._block_states(batch, idx)).float()  # [B', Bk, Vd]
        width = max(num_draft[b] for b in idx)
        draft_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, K]
        parents = torch.full((len(batch), width), -1, dtype=torch.long)  # [B, K]
        num = torch.zeros(len(batch), dtype=torch.long)
        for i, b in enumerate(idx):
            prev = int(self.t2d[batch[b].token_ids[-1]])
            ids, pars, scores, depths = markov_tree(
                U[i], self._correction, self.vocab, prev, num_draft[b], self.tree.topk
            )
            toks = self.vocab.to_target(torch.tensor(ids, dtype=torch.long)).tolist()
            if self.tree.lookup:  # prompt lookup's branch joins by its score
                ctx = np.asarray(batch[b].token_ids, dtype=np.int64)
                prefix, logp = lookup_prefix(ctx, min(num_draft[b], TREE_DEPTH))
                if prefix is not None:
                    nodes = range(len(toks))
                    toks, pars = join_by_score(nodes, toks, pars, scores, depths, prefix, logp, num_draft[b])
            draft_ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            parents[b, : len(toks)] = torch.tensor(pars, dtype=torch.long)
            num[b] = len(toks)
        return Proposal(draft_ids, num, parents=parents, tree_iid=False, catch_up_s=catch_up_s)

    def _chain_op(self, U: torch.Tensor, sampled: bool = False):
        """The compiled Markov pass when it applies, else None: greedy (`kernels`' markov_argmax)
        or sampled at a plain temperature (markov_sample)."""
        ops = kernels.fused()
        cpu_f32 = U.device.type == "cpu" and U.dtype == torch.float32
        name = "markov_sample" if sampled else "markov_argmax"
        return getattr(ops, name, None) if ops is not None and self.markov is not None and cpu_f32 else None

    def _draft(self, batch, idx, states, num):
        net, K, n = self.net, max(num), len(idx)
        num = list(num)
        params = [batch[b].params for b in idx]
        greedy = all(row.params.greedy for row in batch)  # point masses: q stays None
        U = self._logits(states[:, :K])  # [B', K, Vd] backbone logits
        z_state = states[:, :K].float() @ self.conf_w  # [B', K] the slots' part of the confidence logits
        temp, bias = net.sts_temperature.float(), net.sts_bias.float()  # [Bk]
        prev = self.t2d[torch.tensor([batch[b].token_ids[-1] for b in idx], device=self.device)]  # [B']
        chain = greedy and self.threshold is None and self._chain_op(U)
        # One temperature for the batch and no top-k / top-p: the sampled pass in one call too,
        # with the uniforms the loop below would draw (per request, position by position).
        p0 = params[0]
        plain = all(p == p0 for p in params) and plain_temperature(p0, U.shape[-1])
        sampled = not greedy and self.threshold is None and plain and self._chain_op(U, sampled=True)
        q = None
        if chain:  # the whole greedy pass in one call, the loop's arithmetic
            ids = chain(U, self.markov, prev, self.vocab.off)  # [B', K]
        elif sampled:
            u = torch.stack([self._uniforms(batch, idx, num, j) for j in range(K)], 1)  # [B', K]
            ids, q = sampled(U, self.markov, prev, self.vocab.off, u, p0.temperature)  # [B', K], [B', K, Vd]
        compiled = bool(chain or sampled)
        if compiled:
            prevs = torch.cat([prev[:, None], ids[:, :-1]], dim=1)  # [B', K] x_{k-1} per slot
        else:
            # Drafts and confidences stay on the device; the host reads them once at the end
            # (and per slot only when a threshold has to be checked).
            ids = torch.zeros(n, K, dtype=torch.long, device=self.device)  # draft ids
            q = None if greedy else torch.zeros(n, K, U.shape[-1], device=self.device)  # [B', K, Vd]
            prevs = torch.zeros(n, K, dtype=torch.long, device=self.device)  # x_{k-1} per slot
            survival = torch.ones(n, device=self.device)
        for j in range(0 if compiled else K):
            prevs[:, j] = prev
            if self.threshold is not None:  # confidences now; without a threshold, after the loop
                c = torch.sigmoid((z_state[:, j] + self.conf_row[prev]) / temp[j] + bias[j])  # [B']
                survival = survival * c
                score = (survival if self.threshold_on == "survival" else c).tolist()
                for i in range(n):
                    if j < num[i] and score[i] < self.threshold:
                        num[i] = j  # stop before sampling x_j: decided from x_{<j} only
            if all(j >= k for k in num):
                break
            if self.markov is None:
                logits = net.markov_logits(U[:, j], prev)  # [B', Vd]
            else:
                logits = U[:, j] + self.markov[prev].to(U.dtype)  # [B', Vd]
            if greedy:  # the point mass at the argmax: what temperature 0 processing gives
                x = self.vocab.argmax(logits)
            else:
                q[:, j] = self.vocab.probs(logits[:, None], params)[:, 0]
                x = sample(q[:, j], self._uniforms(batch, idx, num, j).to(self.device))  # [B'] draft ids
            ids[:, j] = x
            prev = x  # a draft id is its own row of W1 (only the anchor may be "other")
        slots = z_state.shape[1]
        conf = torch.sigmoid((z_state + self.conf_row[prevs]) / temp[:slots] + bias[:slots])  # [B', K]
        K = max(max(num), 0)
        q = None if q is None else q[:, :K]
        return self.vocab.to_target(ids[:, :K]).cpu(), q, num, {"confidences": conf[:, :K].cpu()}
