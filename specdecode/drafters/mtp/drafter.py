"""MTP drafting: D chained modules draft D tokens, each with the causal context of its depth.

Contract:
- `MTPDrafter(model, target)` captures the target's final normed state (`h^0`). Module k's row
  at position i needs token t_{i+k}, so its KV cache is committed only up to position n - k
  (x_n = the last committed token); the rows past that are drafted each round from the
  previous depth's draft-time states and the drafts so far, written past the committed rows
  and never committed. Per slot it keeps the states h^k of committed rows (`hist[k]`, `Rows`:
  appended in place, so a long context costs no copy a step).
- Drafts are sampled left to right from each module's processed q (the request's sampling,
  q returned over the draft vocabulary for rejection sampling: `Proposal.draft_vocab`); at
  most D drafts per round. When every request is greedy, each draft is the argmax and the
  proposal carries point masses (no q). Requests are drafted one at a time (their depths'
  committed lengths differ).
- Depth grows with evidence: a request drafts with module 1 alone at first, and one module
  deeper once the rounds drafted at its current depth show the deepest draft accepted often:
  (accepted + 1) / (drafted + 2) >= `GROW_AT` over those rounds (two of two, four of five...;
  `reach`; `start_depth` > 1 starts deeper, e.g. to test the law of K-draft rounds from the
  first). One lucky round does not make a weak drafter catch a deeper module up over a long
  prompt (on a 1,754-token prompt module 2's catch-up takes ~100 ms, ~4 target steps). A
  round that drafts K catches up modules 1..K only (in blocks of `CATCH_UP_ROWS` rows, one
  fused-layer call each under the plans measured so far), so a weak drafter never runs its deep
  modules over a long prompt (module 1 reads the prompt in `prefill`). Module
  k >= 2's catch-up and its k - 1 draft-time rows are one
  call (the committed rows first, causal), so a K-draft round runs each module once.
- On CPU in fp32 with our kernels in the target's plan, a module's rows are one compiled call
  (`kernels`' mtp_module: input product, then the block) and each draft one more (head_draft:
  norm, head product, argmax or a draw at a plain temperature with the same uniform), the Python
  modules' functions in their order: the same drafts, without ~20 small operators a module.
Legend: d width, D modules, Vd draft vocabulary, V target vocabulary rows.
"""

from __future__ import annotations

import torch

from specdecode.drafter import Drafter, DraftRow, Proposal, empty_proposal, prompt_row
from specdecode.drafters.layers import (
    DraftVocab,
    attend,
    cpu_plan,
    rope_table,
    signed_rope_rows,
    whole_layer_args,
)
from specdecode.models import formats, kernels
from specdecode.models.base import FINAL_NORM
from specdecode.models.kv_cache import KVCache
from specdecode.sampling import plain_temperature, sample
from specdecode.verify import Verdict

GROW_AT = 0.7  # posterior mean of the deepest draft's acceptance that earns one module more
CATCH_UP_ROWS = 64  # rows of a catch-up call: blocks our fused layer takes whole under the
# measured plans seen so far (longer blocks fall back to the Python attention over the block)


class MTPDrafter(Drafter):
    name = "mtp"
    deterministic = False
    needs_hidden = (FINAL_NORM,)

    def __init__(self, model, target, cost_per_token: float = 0.1, start_depth: int = 1):
        self.net = model.eval()
        self.target = target.model
        self.vocab_size = target.vocab_size
        self.cost_per_token = cost_per_token
        self.start_depth = max(1, min(start_depth, len(model.mods)))
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.vocab = DraftVocab(model.d2t.to(self.device), self.vocab_size)
        self.net.attach_head(target.model.lm_head_weight())
        plan = cpu_plan(target)  # the head rows [Vd, d] as one product, in the target's formats
        self._head = None if plan is None else formats.Linear(self.net._head[0], None, plan)
        self.caches: list[KVCache] = []
        self.hist: dict[int, list[Rows]] = {}  # slot -> [h^0, h^1, ..., h^D], each [n_k, d]
        self.reach: dict[int, int] = {}  # slot -> deepest module it may draft with
        self.evidence: dict[int, list[int]] = {}  # slot -> [accepted, drafted] at depth reach
        self._whole: dict[tuple[int, int], tuple | None] = {}  # (module, rows) -> mtp_module's args

    def setup(self, num_slots: int, max_len: int) -> None:
        c = self.net.cfg
        self.caches = [
            KVCache(
                1,
                num_slots,
                max_len + 2 * c.num_modules + 2,
                c.num_kv_heads,
                c.head_dim,
                self.dtype,
                self.device,
            )
            for _ in range(c.num_modules)
        ]

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        d = self.net.cfg.hidden_size
        h0 = (hidden or {}).get(FINAL_NORM)
        h0 = torch.zeros(0, d) if h0 is None else h0
        self.hist[slot] = [Rows(h0.to(self.device, self.dtype))] + [
            Rows(torch.zeros(0, d, dtype=self.dtype, device=self.device)) for _ in self.net.mods
        ]
        self.reach[slot], self.evidence[slot] = self.start_depth, [0, 0]
        for c in self.caches:
            c.reset(slot)

    def prefill(self, slot: int, prompt_ids: list[int]) -> None:
        self._catch_up(prompt_row(slot, prompt_ids), 1)  # module 1 over the prompt

    def stop(self, slot: int) -> None:
        self.hist.pop(slot, None)
        self.reach.pop(slot, None)
        self.evidence.pop(slot, None)

    @torch.no_grad()
    def _run(self, k: int, slot: int, h_prev, tok: list[int], first_pos: int, commit: int) -> torch.Tensor:
        """Module k over positions first_pos.. (rows at the cache's committed end) -> [N, d];
        the first `commit` rows are committed (the rest are written past the committed end)."""
        cfg, mod, cache = self.net.cfg, self.net.mods[k - 1], self.caches[k - 1]
        n = len(tok)
        base = cache.lengths[slot]
        assert base == first_pos, (base, first_pos)  # module k's cache rows are indexed by position
        emb = self.target.embed(torch.tensor([tok], device=self.target.info.device)).to(
            self.device, self.dtype
        )
        out = self._run_whole(k, slot, h_prev, emb[0], base)
        if out is not None:
            cache.commit(slot, commit)
            return out
        pos = torch.arange(first_pos, first_pos + n, device=self.device)[None] + k  # t_{i+k} sits at i + k
        cos, sin = rope_table(pos, cfg.head_dim, cfg.rope_theta)
        x = mod.inp(h_prev[None], emb)
        q, kk, v = mod.qkv(x, cos, sin)
        cache.k[0][slot, :, base : base + n] = kk[0].transpose(0, 1)
        cache.v[0][slot, :, base : base + n] = v[0].transpose(0, 1)
        keys = cache.k[0][slot, :, : base + n].transpose(0, 1)[None]  # [1, base+n, Hk, D]
        values = cache.v[0][slot, :, : base + n].transpose(0, 1)[None]
        vis = (
            torch.arange(base + n, device=self.device)[None, :]
            <= (base + torch.arange(n, device=self.device))[:, None]
        )
        out = mod.finish(x, attend(q, keys, values, vis[None]))[0]  # [n, d]
        cache.commit(slot, commit)
        return out

    def _module_args(self, k: int, N: int) -> tuple | None:
        """mtp_module's arguments for module k over N rows (its input product's, then decode_layer's
        products and q/k norms), when each of those products runs one of our compiled kernels (the
        plan's format for N rows) on CPU in fp32; else None."""
        if (k, N) not in self._whole:
            mod, ops, args = self.net.mods[k - 1], kernels.fused(), None
            if self.device.type == "cpu" and self.dtype == torch.float32 and hasattr(ops, "mtp_module"):
                layer = whole_layer_args(mod.attn, mod.mlp, mod.mlp_norm, N)
                proj = getattr(getattr(mod.proj, "product", None), "ours", lambda rows: None)(N)
                if layer is not None and proj is not None and proj[3] is None:
                    args = (proj[:3], *layer)
            self._whole[(k, N)] = args
        return self._whole[(k, N)]

    def _run_whole(self, k: int, slot: int, h_prev, emb, base: int) -> torch.Tensor | None:
        """Module k over N rows at cache rows (= positions) base.. (causal) as `kernels`'
        mtp_module (its input product, then decode_layer: the modules' math in one call, with its
        own rounding of RoPE and attention), when `_module_args` has them; else None. h_prev,
        emb [N, d] -> [N, d]."""
        n = h_prev.shape[0]
        args = self._module_args(k, n)
        if args is None:
            return None
        cfg, mod, cache = self.net.cfg, self.net.mods[k - 1], self.caches[k - 1]
        proj, layer, norms = args
        cs = signed_rope_rows(
            base + k, n, cfg.head_dim, cfg.rope_theta, self.device
        )  # [N, 2, D]: t_{i+k} at i + k
        return kernels.fused().mtp_module(
            h_prev, emb, mod.hnorm.weight, mod.enorm.weight, *proj, mod.attn_norm.weight, *layer, cs,
            cache.k[0][slot : slot + 1], cache.v[0][slot : slot + 1], base, cfg.rms_norm_eps,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, **norms,
        )  # fmt: skip

    def _catch_up(self, row: DraftRow, depth: int) -> None:
        """Commit module k's rows (k = 1..depth) for positions whose token t_{i+k} is known
        (i <= n - k). Deeper modules wait until a round drafts that deep: a probe that drafts
        one token after many rounds without drafts runs module 1 alone."""
        for k in range(1, depth + 1):
            self._commit_known(row, k)

    def _commit_known(self, row: DraftRow, k: int) -> None:
        """Module k's catch-up: its rows up to position min(n - k, the last with a depth k-1
        state), in blocks of `CATCH_UP_ROWS` (a prompt in blocks our kernels take whole)."""
        hist, n, toks = self.hist[row.slot], len(row.token_ids) - 1, row.token_ids
        c = self.caches[k - 1].lengths[row.slot]
        end = min(n - k, len(hist[k - 1]) - 1)  # last position to commit
        for c0 in range(c, end + 1, CATCH_UP_ROWS):
            c1 = min(end + 1, c0 + CATCH_UP_ROWS)
            prev = hist[k - 1].view[c0:c1]
            hist[k].append(self._run(k, row.slot, prev, toks[c0 + k : c1 + k], c0, commit=c1 - c0))

    def _draft_rows(self, k: int, row: DraftRow, drafts: list[int], spec_prev) -> torch.Tensor | None:
        """Module k >= 2's states at positions c..n-1 (c: its committed length), one call: the
        rows whose token t_{i+k} is known (i <= n - k) are committed (the catch-up), the k - 1
        after them read depth k-1's draft-time states `spec_prev` and the drafts so far, and are
        not. A catch-up longer than a block goes first, in blocks. None: too early in the
        sequence for this depth (its catch-up is still done)."""
        hist, n, slot = self.hist[row.slot], len(row.token_ids) - 1, row.slot
        if len(hist[k - 1]) < n - k + 2:  # depth k-1 has no state at n - k + 1 yet
            self._commit_known(row, k)
            return None
        if n - self.caches[k - 1].lengths[slot] > CATCH_UP_ROWS:  # commits up to n - k
            self._commit_known(row, k)
        c = self.caches[k - 1].lengths[slot]
        h_prev = torch.cat([hist[k - 1].view[c:], spec_prev])  # [n - c, d] positions c..n-1
        toks = (row.token_ids + drafts)[c + k : n + k]
        if h_prev.shape[0] != len(toks):
            return None
        known = n - k + 1 - c  # rows whose token t_{i+k} is known: committed
        out = self._run(k, slot, h_prev, toks, c, commit=known)
        hist[k].append(out[:known])
        return out[known:]

    def _logits(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """Module k's draft-vocabulary logits [1, Vd] of one state [d] (MTP.logits' function)."""
        if self._head is None:
            return self.net.logits(k, state[None])
        return self._head(self.net.mods[k - 1].out_norm(state[None])).float()

    def _head_args(self) -> tuple | None:
        """head_draft's product arguments (kind, packed, outputs) when the draft head's product of
        one row is one of our compiled kernels; else None."""
        head = None if self._head is None or kernels.fused() is None else self._head.ours(1)
        return head[:3] if head is not None and head[3] is None else None

    def _draft(self, k: int, state, row: DraftRow, greedy: bool) -> tuple[int, torch.Tensor | None]:
        """Module k's draft from one state [d] -> (target id, q [Vd] or None when greedy): the
        argmax (the point mass temperature 0 processing gives), or a draw from the request's
        processed q with one uniform of its generator. One `head_draft` call when the head's
        product is our kernel and the sampling is greedy or a plain temperature."""
        head = self._head_args()
        if head is not None and (greedy or plain_temperature(row.params, len(self.vocab.d2t))):
            u = 0.0 if greedy else float(torch.rand((), generator=row.generator))
            t = 0.0 if greedy else row.params.temperature
            w, eps = self.net.mods[k - 1].out_norm.weight, self.net.cfg.rms_norm_eps
            ids, q = kernels.fused().head_draft(state[None], w, eps, *head, self.vocab.off, u, t)
            return int(self.vocab.d2t[ids[0]]), None if greedy else q[0]
        if greedy:
            return int(self.vocab.to_target(self.vocab.argmax(self._logits(k, state)))[0]), None
        q = self.vocab.probs(self._logits(k, state)[:, None], [row.params])[0, 0]  # [Vd]
        u = torch.rand((), generator=row.generator)
        return int(self.vocab.to_target(sample(q[None], u[None].to(q.device)))[0]), q

    @torch.no_grad()
    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        D = len(self.net.mods)
        idx = [b for b, k in enumerate(num_draft) if k > 0]
        depth = {b: min(D, num_draft[b], self.reach[batch[b].slot]) for b in idx}
        for b in idx:  # module 1 here; deeper ones with their draft rows (`_draft_rows`)
            self._catch_up(batch[b], 1)
        idx = [b for b in idx if len(self.hist[batch[b].slot][1]) >= len(batch[b].token_ids) - 1 > 0]
        if not idx:
            return empty_proposal(len(batch))
        max_k = max(depth[b] for b in idx)
        greedy = all(batch[b].params.greedy for b in idx)  # point masses: no q, no probabilities
        ids = torch.zeros(len(batch), max_k, dtype=torch.long)
        probs = None if greedy else torch.zeros(len(batch), max_k, len(self.vocab.d2t))  # [B, K, Vd]
        num = torch.zeros(len(batch), dtype=torch.long)
        for b in idx:
            row, hist = batch[b], self.hist[batch[b].slot]
            n, K = len(row.token_ids) - 1, depth[b]
            drafts: list[int] = []
            spec_prev = None  # depth k-1 draft-time states at positions n-k+2 .. n-1
            for k in range(1, K + 1):
                if k == 1:
                    state = hist[1].view[n - 1]
                else:
                    spec = self._draft_rows(k, row, drafts, spec_prev)
                    if spec is None:
                        break  # too early in the sequence for this depth
                    state = spec[-1]
                x, q = self._draft(k, state, row, greedy)
                if q is not None:
                    probs[b, k - 1] = q.float().cpu()  # over the draft vocabulary (Proposal.draft_vocab)
                drafts.append(x)
                ids[b, k - 1] = x
                spec_prev = spec if k > 1 else hist[1].view[n:n]  # depth 1 has no draft-time rows
            num[b] = len(drafts)
        vocab = None if probs is None else self.vocab.d2t
        return Proposal(draft_ids=ids, num_draft=num, draft_probs=probs, draft_vocab=vocab)

    def advance(self, batch: list[DraftRow], proposal: Proposal, verdicts: list[Verdict], target_out) -> None:
        h = target_out.hidden[FINAL_NORM]  # [B, N, d]
        for b, row in enumerate(batch):
            k, slot = int(proposal.num_draft[b]), row.slot
            if k and k == self.reach[slot] < len(self.net.mods):  # a round at the full depth
                ev = self.evidence[slot]
                ev[0], ev[1] = ev[0] + (verdicts[b].num_accepted == k), ev[1] + 1
                if (ev[0] + 1) / (ev[1] + 2) >= GROW_AT:
                    self.reach[slot], self.evidence[slot] = k + 1, [0, 0]
            self.hist[slot][0].append(h[b, : verdicts[b].num_accepted + 1].to(self.device, self.dtype))


class Rows:
    """Rows [n, d] that grow at the end in amortised O(1) (the storage doubles when full):
    `view` is the rows so far, `append(x)` adds x [m, d]."""

    def __init__(self, rows: torch.Tensor):
        self.buf, self.n = rows, rows.shape[0]

    def __len__(self) -> int:
        return self.n

    @property
    def view(self) -> torch.Tensor:
        return self.buf[: self.n]

    def append(self, x: torch.Tensor) -> None:
        m = x.shape[0]
        if self.n + m > self.buf.shape[0]:
            grown = self.buf.new_empty(max(2 * self.buf.shape[0], self.n + m, 64), self.buf.shape[1])
            grown[: self.n] = self.view
            self.buf = grown
        self.buf[self.n : self.n + m] = x
        self.n += m
