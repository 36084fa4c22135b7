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
  sums and first-maximum argmax as the per-slot loop, so the same drafts), and so is the pass
  sampled at one plain temperature (markov_sample); where the head is one of our kernels too,
  the head product, that pass and the confidences are one call (`kernels`' markov_draft,
  `_round_op`; confidences equal to rounding).
- Inference reads the confidence head as `DSpark.confidence_tables()` (one product for all
  slots' state parts, one table entry per slot for the previous token's part), per slot only
  when a threshold needs it, else for all slots after the pass. When every request of the batch
  is greedy, x_k is the argmax of the corrected logits and the proposal carries point masses
  (what processing at temperature 0 gives), without the per-slot processing.
- Confidences go to `Proposal.extras["confidences"]` ([B, K], c_k per draft) for the serving
  scheduler (`provides_confidences`).
- Tree (`tree=BlockTree(...)`, DFlashDrafter's tree rounds and `block_tree` with the
  Markov head's term): every slot's distribution is a function of the token before it only, so
  one backbone forward gives a whole tree: node x at depth k has the children top-`topk` of
  log q_{k+1}(. | x) = log_softmax(U_{k+1} + W2(W1[x])). Tree rounds carry no confidences (the
  adaptive policy picks K from measured acceptance).
- Per-request truncation: with `confidence_threshold`, a request stops drafting at the first k
  whose c_k ("confidence") or prefix survival a_k = prod_{i<=k} c_i ("survival") is below the
  threshold. The decision for slot k reads only c_k, which depends on x_{k-1} but never on x_k,
  so the output distribution stays the target's.
"""

from __future__ import annotations

import torch

from specdecode.drafters.dflash.drafter import BlockTree, DFlashDrafter
from specdecode.drafters.dflash.model import t2d_table
from specdecode.drafters.dspark.model import DSpark
from specdecode.errors import SpecDecodeError
from specdecode.models import kernels
from specdecode.sampling import sample

THRESHOLD_ON = ("survival", "confidence")
# The Markov table trades memory for the per-slot product: (Vd + 1) x Vd values (134 MB in bf16,
# 268 MB in fp32 for the default Vd 8192); larger draft vocabularies keep the product.
MARKOV_TABLE_BYTES = 300 * 2**20


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
        tree: BlockTree | None = None,
    ):
        super().__init__(net, target, cost_per_token, tree=tree)
        if tree is not None:  # tree rounds: K from measured acceptance
            if confidence_threshold is not None:
                raise SpecDecodeError("--confidence-threshold truncates chains; a dspark tree takes none")
            self.provides_confidences = False
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise SpecDecodeError(f"--confidence-threshold must be in [0, 1], got {confidence_threshold}")
        if threshold_on not in THRESHOLD_ON:
            raise SpecDecodeError(f"threshold_on must be one of {THRESHOLD_ON}, got {threshold_on!r}")
        self.threshold, self.threshold_on = confidence_threshold, threshold_on
        self.t2d = t2d_table(net.d2t, self.vocab_rows).tolist()  # [V] target id -> draft id, Python ints
        self.conf_w, self.conf_row = (t.to(self.device) for t in net.confidence_tables())  # [d], [Vd + 1]
        dtype = net.W2.weight.dtype
        Vd = net.cfg.draft_vocab_size
        fits = (Vd + 1) * Vd * dtype.itemsize <= MARKOV_TABLE_BYTES
        self.markov = net.markov_table().to(self.device, dtype) if fits else None  # [Vd + 1, Vd]
        self._round_ops: dict = {}  # rows -> `_round_op`'s call, or None

    def _correction(self, prev: torch.Tensor) -> torch.Tensor:  # [n] draft ids -> [n, Vd]: W2(W1[prev])
        if self.markov is not None:
            return self.markov[prev]
        return self.net.W2(self.net.W1(prev))

    def _children_op(self, U: torch.Tensor):
        """block_tree's `children` through `kernels`' markov_topk where it applies (`_markov_op`),
        else None."""
        op = self._markov_op(U, "markov_topk")
        if op is None:
            return None
        table, off = self.markov, self.vocab.off

        def children(u: torch.Tensor, tok: int, k: int) -> tuple[list[float], list[int]]:
            vals, ids = op(u, table, tok, off, k)
            return vals.tolist(), ids.tolist()

        return children

    def _anchor_draft_id(self, token: int) -> int:
        return self.t2d[token]

    def _markov_op(self, U: torch.Tensor, name: str):
        """`kernels`' Markov op `name` where it applies (the extension built, the Markov table held,
        U fp32 on the CPU), else None."""
        ops = kernels.fused()
        cpu_f32 = U.device.type == "cpu" and U.dtype == torch.float32
        return getattr(ops, name, None) if ops is not None and self.markov is not None and cpu_f32 else None

    def _round_op(self, states: torch.Tensor, rows: int):
        """`kernels`' markov_draft for a round without a threshold, greedy or at one plain
        temperature, as (states [B', K, d], prev [B'], temp, bias, uniforms [B', K] | None,
        temperature) -> (draft ids [B', K], confidences [B', K], q [B', K, Vd] | [0]): the head
        product over `rows` rows, the Markov chain (markov_argmax's, or markov_sample's with the
        loop's uniforms) and c_k, where it applies (the extension built, the Markov table held,
        fp32 states on the CPU, the head one of our kernels at that many rows); else None."""
        if states.device.type != "cpu" or states.dtype != torch.float32:
            return None
        if rows not in self._round_ops:  # made once per number of rows
            self._round_ops[rows] = self._make_round_op(rows)
        return self._round_ops[rows]

    def _make_round_op(self, rows: int):
        """`_round_op`'s call for `rows` rows, or None."""
        got = self._head_kernel("markov_draft", rows)
        if got is None or self.markov is None:
            return None
        call, kind, packed, n_out = got
        table, off, w, row = self.markov, self.vocab.off, self.conf_w.float(), self.conf_row.float()

        def run(s, prev, temp, bias, u, t):
            return call(s, kind, packed, n_out, table, prev, off, w, row, temp, bias, u, t)

        return run

    def _chain_op(self, U: torch.Tensor, sampled: bool = False):
        """The compiled Markov pass when it applies, else None: greedy (`kernels`' markov_argmax)
        or sampled at a plain temperature (markov_sample)."""
        return self._markov_op(U, "markov_sample" if sampled else "markov_argmax")

    def _draft(self, batch, idx, states, num):
        net, K, n = self.net, max(num), len(idx)
        num = list(num)
        params = [batch[b].params for b in idx]
        temp, bias = net.sts_temperature.float(), net.sts_bias.float()  # [Bk]
        prev = torch.tensor([self.t2d[batch[b].token_ids[-1]] for b in idx]).to(self.device)  # [B']
        # All greedy (point masses: q stays None), or one temperature for the batch and no top-k /
        # top-p: the sampled pass in one call too, with the uniforms the loop below would draw (per
        # request, position by position).
        greedy, plain = self._plain(batch, params)
        p0 = params[0]
        whole = plain and self.threshold is None and self._round_op(states, n * K)
        if whole:  # head, chain (greedy or sampled) and confidences in one call
            u = None if greedy else self._uniform_rows(batch, idx, num, K)  # [B', K]
            ids, conf, q = whole(states[:, :K], prev, temp, bias, u, 1.0 if greedy else p0.temperature)
            return self.vocab.to_target(ids), None if greedy else q, num, {"confidences": conf}
        U = self._logits(states[:, :K])  # [B', K, Vd] backbone logits
        z_state = states[:, :K].float() @ self.conf_w  # [B', K] the slots' part of the confidence logits
        chain = greedy and self.threshold is None and self._chain_op(U)
        sampled = not greedy and self.threshold is None and plain and self._chain_op(U, sampled=True)
        q = None
        if chain:  # the whole greedy pass in one call, the loop's arithmetic
            ids = chain(U, self.markov, prev, self.vocab.off)  # [B', K]
        elif sampled:
            u = self._uniform_rows(batch, idx, num, K)  # [B', K]
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
            logits = U[:, j] + self._correction(prev).to(U.dtype)  # [B', Vd]
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
