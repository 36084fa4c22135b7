"""DFlash drafting at inference: one forward of the drafter fills a whole block.

Contract:
- `DFlashDrafter(net, target)` wraps a trained `DFlash`. It captures the target's 5
  `feature_layers` during prefill and verification (`needs_hidden`). Per slot it keeps a KV cache
  of context rows only (one entry per committed token whose target features are known, at its
  absolute position): `advance` queues the features of the verified block's kept rows (the
  anchor and the accepted drafts), the next `propose` fuses them and appends their per-layer
  keys/values (one batched projection, no layer pass: context rows are injected, not run; with our
  CPU kernels one product for every layer's keys and values, `_context_kv`, and for one slot the
  whole catch-up in one `kernels`' context_rows call, `_context_rows`). With our kernels, one
  request's block runs every layer in one decode_layers call (`_block_whole`), and a round greedy
  or at one plain temperature takes its head product and every slot's argmax or draw in one
  head_rows call (`_head_op`: the same drafts; q equal up to the rounding of its exponentials).
- `propose`: block = [anchor = last committed token, MASK x (B-1)] at positions anchor + k (MASK:
  the learned `mask_emb`, or the target's embedding of `mask_token_id` when the config sets one),
  attending to the context rows (all strictly before the anchor) and to the whole block; the
  block's keys/values are never written to the cache, so nothing needs cropping. The draft
  slots' logits (frozen target head over the draft vocabulary) give one processed q per slot
  (the request's temperature / top-k / top-p); draft k is sampled from q_k with the request's
  generator (exactly `num_draft[b]` uniforms per request) and q_k is returned for rejection
  sampling. DFlash slots are independent given the context, so every q_k is known at once.
  Processing and sampling run over the Vd draft ids (`DraftVocab`); q goes to the verifier
  over the draft ids (`Proposal.draft_vocab`: no scatter to the target vocabulary). When
  every request of the batch is greedy, draft k is the argmax and the proposal carries point
  masses (`draft_probs` None: what temperature 0 processing gives, and what greedy
  verification reads) without the processing and without uniforms (a greedy request's
  generator decides nothing).
- Tree (`tree=BlockTree(topk, lookup, max_temperature)`): one block forward gives a whole tree
  (`block_tree`): the anchor's children are the top-`topk` draft ids of the first draft slot, a
  node at depth k gets the top-`topk` of slot k + 1 (DFlash's slots are independent given the
  context, so every node at a depth ranks the same candidates; DSpark adds its Markov term for
  the node's own token), and nodes join best first by cumulative log q up to the round's K
  nodes, at most one block deep. With `lookup`, prompt lookup's continuation joins by its score
  (`ngram.lookup_prefix`, `tree.join_by_score`). Siblings are chosen deterministically, so the
  loop verifies point-mass candidates: a candidate is accepted with the target's probability of
  it, lossless at any temperature. A round whose requests all sample at T <= `max_temperature`
  (0.7) drafts the same tree (at most a block's worth of nodes for a sampled request, the
  policy's `sampled_k_max`); a hotter round drafts the sampled chain: on SmolLM2 the point-mass
  tree kept far more than the sampled chain at T 0.3-0.7, and at T 1 its adaptive rounds ran
  slower (benchmarks/results/served-tau-block-tree-sampling.md and the bench beside it).
- Subclasses (DSpark) override `_draft(...)` to sample the slots sequentially, and
  `_correction` / `_anchor_draft_id` to condition a tree node's children on its token.
Legend: B requests, Bk block slots, K drafts, d width, Vd draft vocab, V target vocab rows.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import torch

from specdecode.drafter import Drafter, DraftRow, Proposal, empty_proposal, gather_features
from specdecode.drafters.dflash.model import DFlash
from specdecode.drafters.layers import (
    DraftVocab,
    PlannedLinear,
    cpu_plan,
    norm_eps,
    signed_rope_rows,
    signed_rope_table,
    whole_layer_args,
)
from specdecode.drafters.ngram import lookup_prefix
from specdecode.models import formats, kernels
from specdecode.models.kv_cache import KVCache
from specdecode.sampling import plain_temperature, sample
from specdecode.tree import join_by_score
from specdecode.verify import Verdict


@dataclass(frozen=True)
class BlockTree:
    topk: int = 4  # children ranked per expanded node
    lookup: bool = False  # prompt lookup's continuation joins the tree by its score
    # A round drafts the tree when every request's temperature is at most this (greedy: 0), else
    # the sampled chain (benchmarks/results/bench-smollm2-135m-amx-block-tree-sampling).
    max_temperature: float = 0.7

    def __post_init__(self):
        if not self.max_temperature >= 0.0:
            raise ValueError(f"max_temperature must be >= 0, got {self.max_temperature!r}")

    def drafts_tree(self, params) -> bool:
        """Whether a round of requests with these sampling settings drafts the tree."""
        return all(p.greedy or p.temperature <= self.max_temperature for p in params)


def block_tree(
    U: torch.Tensor,  # [Bk, Vd] logits of one request's draft slots
    correction,  # None (slots independent: DFlash), or draft ids [1] -> [1, Vd] (DSpark's W2(W1[x]))
    vocab: DraftVocab,
    prev: int,  # draft id of the anchor (what `correction` reads first)
    budget: int,
    topk: int,
    children=None,  # None, or (U[k] [Vd], draft id, topk) -> (log q, draft ids) of that node's children
) -> tuple[list[int], list[int], list[float], list[int]]:
    """The `budget` best nodes of the block's tree by cumulative log q, best first (so parents
    before children): (draft ids, parents (-1: the anchor), cumulative log q, depths). A node at
    depth k (1..Bk) is drafted at slot k - 1; its children rank the top-`topk` of
    log_softmax(U[k] + correction(node)) (of U[k] without one: the same for every node of a
    depth, ranked once), or what `children` gives (a compiled ranking of the same). Ties go to
    the shallower node, then the earlier push."""
    toks: list[int] = []
    pars: list[int] = []
    scores: list[float] = []
    depths: list[int] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, depth, push order, parent, draft id)
    order = itertools.count()
    per_depth: dict[int, tuple[list[float], list[int]]] = {}  # without a correction

    def ranked(depth: int, tok: int) -> tuple[list[float], list[int]]:
        if children is not None:
            return children(U[depth], tok, topk)
        if correction is None and depth in per_depth:
            return per_depth[depth]
        logits = U[depth]  # [Vd]
        if correction is not None:
            logits = logits + correction(torch.tensor([tok], device=U.device))[0].to(U.dtype)
        lp = vocab.log_probs(logits)  # [Vd]
        top = lp.topk(min(topk, lp.shape[-1]))
        got = top.values.tolist(), top.indices.tolist()
        if correction is None:
            per_depth[depth] = got
        return got

    def push_children(node: int, depth: int, tok: int, score: float) -> None:
        for s, t in zip(*ranked(depth, tok), strict=True):
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


class DFlashDrafter(Drafter):
    name = "dflash"
    deterministic = False

    def __init__(self, net: DFlash, target, cost_per_token: float = 0.02, tree: BlockTree | None = None):
        self.net = net.eval()
        self.tree = tree
        if tree is not None:  # a sampled request's round: at most a block's worth of drafts or nodes
            self.sampled_k_max = net.cfg.num_drafts
        self.target = target.model
        self.vocab_size = target.vocab_size  # tokenizer size: ids past it never drafted
        self.vocab_rows = target.model.info.vocab_size  # V
        self.layers = tuple(net.cfg.feature_layers)
        self.needs_hidden = tuple(dict.fromkeys(self.layers))
        self.cost_per_token = cost_per_token
        p = next(net.parameters())
        self.dtype, self.device = p.dtype, p.device
        d2t = net.d2t.to(target.model.info.device)
        self.head_w = target.model.lm_head_weight()[d2t].detach().to(self.device, self.dtype)  # [Vd, d]
        plan = cpu_plan(target)
        self._plan = getattr(net, "formats_plan", plan) if plan and self.device.type == "cpu" else None
        # The head rows are the target's weights: they run in the target's plan, as the target
        # runs them, never in an int8-stored drafter's plan (its int8w would re-quantize them: a
        # different head, whose greedy drafts differed in ~4 % of positions, chosen by a timing)
        self.head = PlannedLinear(self.head_w, None, plan) if self._plan else None
        self._kv_all = None  # every layer's context key/value product (`_kv_product`), made once
        self._mask = None  # the mask slots' vector (`_mask_vector`), made once
        self.vocab = DraftVocab(net.d2t.to(self.device), self.vocab_size)
        self.cache: KVCache | None = None
        self._pending: dict[int, list[torch.Tensor]] = {}  # slot -> queued [n, 5d] features
        self._whole: dict[int, tuple | None] = {}  # block rows -> `_layers_args`
        self._head_ops: dict = {}  # rows -> `_head_op`'s call, or None

    # ---- slots ----------------------------------------------------------------------------
    def setup(self, num_slots: int, max_len: int) -> None:
        c = self.net.cfg
        self.cache = KVCache(
            c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device
        )

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        self.cache.reset(slot)
        feats = self._features(hidden, None) if hidden else None
        self._pending[slot] = [feats] if feats is not None and feats.shape[0] else []

    def prefill(self, slot: int, prompt_ids: list[int]) -> None:
        self._catch_up([slot])  # the prompt's context keys and values

    def stop(self, slot: int) -> None:
        self._pending.pop(slot, None)

    def _features(self, hidden: dict, b: int | None, rows=None) -> torch.Tensor | None:
        """Concatenate the captured layers -> [n, 5d] in the drafter dtype."""
        x = gather_features(hidden, self.layers, b, rows)
        return None if x is None else x.to(self.device, self.dtype)

    # ---- context cache --------------------------------------------------------------------
    @torch.no_grad()
    def _catch_up(self, slots: list[int]) -> None:
        """Fuse the queued features of `slots` and append their keys/values (one projection)."""
        todo = [s for s in slots if self._pending.get(s)]
        if not todo:
            return
        feats = [q[0] if len(q) == 1 else torch.cat(q) for q in (self._pending[s] for s in todo)]  # [n_s, 5d]
        self.cache.check_room(todo, [f.shape[0] for f in feats])
        starts = [self.cache.lengths[s] for s in todo]
        if len(todo) == 1 and self._context_rows(todo[0], starts[0], feats[0]):
            pass  # one slot's rows in one `kernels`' call
        elif len(todo) == 1:  # one slot's consecutive rows, written through views
            s, r0, n = todo[0], starts[0], feats[0].shape[0]
            kv = self._context_kv(self.net.fuse(feats[0]), range(r0, r0 + n))  # per layer (k, v) [N, Hk, D]
            for layer, (k, v) in enumerate(kv):
                self.cache.k[layer][s, :, r0 : r0 + n] = k.transpose(0, 1)  # [Hk, N, D]
                self.cache.v[layer][s, :, r0 : r0 + n] = v.transpose(0, 1)
        else:
            rows = torch.cat([torch.arange(r0, r0 + len(f)) for r0, f in zip(starts, feats, strict=True)])
            rows = rows.to(self.device)  # [N]
            kv = self._context_kv(self.net.fuse(torch.cat(feats)), rows)  # per layer (k, v) [N, Hk, D]
            sl = torch.cat([torch.full((f.shape[0],), s) for s, f in zip(todo, feats, strict=True)])  # [N]
            sl = sl.to(self.device)
            for layer, (k, v) in enumerate(kv):
                self.cache.k[layer][sl, :, rows] = k  # [N, Hk, D]
                self.cache.v[layer][sl, :, rows] = v
        for s, f in zip(todo, feats, strict=True):
            self.cache.commit(s, f.shape[0])
            self._pending[s] = []

    def _context_rows(self, slot: int, r0: int, feats: torch.Tensor) -> bool:
        """One slot's new context rows (features [N, 5d] at cache rows r0..) fused, projected and
        written by one `kernels`' context_rows call: `fuse` then `_context_kv`'s product, per-head
        key norms and RoPE, then the cache writes, the same functions in the same order (so the
        same values). False where it does not apply (the fused product `_kv_product` absent, or
        the fusion's product not one of our kernels at N rows); nothing is written then."""
        prod, fc, norm = self._kv_product(), self.net.fc, self.net.ctx_norm
        ops = kernels.fused()
        if prod is None or not hasattr(ops, "context_rows") or not isinstance(fc, PlannedLinear):
            return False
        if feats.dtype != torch.float32 or norm.weight is None:
            return False
        n = feats.shape[0]
        a, b = fc.product.ours(n), prod.ours(n)
        if a is None or b is None or a[3] is not None or b[3] is not None:
            return False
        c = self.net.cfg
        k_norms = [ly.attn.k_norm.weight for ly in self.net.layers] if c.qk_norm else []
        cs = signed_rope_rows(r0, n, c.head_dim, c.rope_theta, self.device)  # [N, 2, D]
        dst = self.cache.kv[:, :, slot : slot + 1, :, r0 : r0 + n].transpose(3, 4)  # [2, L, 1, N, Hk, D]
        L, Hk, D, eps = c.num_layers, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        ops.context_rows(feats, *a[:3], norm.weight, norm_eps(norm), *b[:3], k_norms, eps, cs, dst, L, Hk, D)
        return True

    def _context_kv(
        self, ctx: torch.Tensor, rows: torch.Tensor | range
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context features [N, d] at positions `rows` ([N], or a range of consecutive ones) ->
        per layer (k, v) [N, Hk, D]: the network's `context_kv`; where `_kv_product` applies,
        every layer's keys and values from one product, their per-head norms and RoPE by our
        kernels (same math, own rounding)."""
        prod = self._kv_product()
        if prod is None:
            if isinstance(rows, range):
                rows = torch.arange(rows.start, rows.stop, device=self.device)
            return [(k[0], v[0]) for k, v in self.net.context_kv(ctx[None], rows[None])]
        c, ops = self.net.cfg, kernels.fused()
        N, L, Hk, D = ctx.shape[0], c.num_layers, c.num_kv_heads, c.head_dim
        w = Hk * D
        kv = prod(ctx)  # [N, 2 L Hk D]: the keys of every layer, then their values
        if c.qk_norm:  # each layer's per-head key norm before RoPE, in place
            for i, layer in enumerate(self.net.layers):
                k = kv[:, i * w : (i + 1) * w]
                normed = ops.rms_norm(k.reshape(N * Hk, D), layer.attn.k_norm.weight, c.rms_norm_eps)
                k.copy_(normed.view(N, w))
        if isinstance(rows, range):  # a view of the cached table
            cs = signed_rope_rows(rows.start, len(rows), D, c.rope_theta, self.device)  # [N, 2, D]
        else:
            cs = signed_rope_table(rows, D, c.rope_theta)  # [N, 2, D]
        ops.rope_(kv, cs, L * Hk)  # the keys' heads only
        return [
            (kv[:, i * w : (i + 1) * w].view(N, Hk, D), kv[:, (L + i) * w : (L + i + 1) * w].view(N, Hk, D))
            for i in range(L)
        ]

    def _kv_product(self):
        """The product [N, d] -> [N, 2 L Hk D] (every layer's key rows, then its value rows) in the
        drafter's CPU format plan (`load_net`'s), made once, where our kernels serve an fp32 drafter;
        else None."""
        if self._kv_all is None:
            ops = kernels.fused()
            self._kv_all = False
            ours = ops is not None and hasattr(ops, "rope_") and self.dtype == torch.float32
            if ours and self._plan is not None:
                attn = [layer.attn for layer in self.net.layers]
                w = torch.cat([a.k_proj.weight for a in attn] + [a.v_proj.weight for a in attn]).detach()
                self._kv_all = formats.Linear(w, None, self._plan)
        return self._kv_all or None

    @torch.no_grad()
    def _block_states(self, batch: list[DraftRow], idx: list[int]) -> torch.Tensor:
        """Final states [B', Bk, d] of one block per request in `idx`."""
        slots = [batch[b].slot for b in idx]
        anchor_pos = [len(batch[b].token_ids) - 1 for b in idx]  # B'
        lens = [self.cache.lengths[s] for s in slots]
        if lens != anchor_pos:
            raise RuntimeError(f"dflash context cache out of step: {lens} != {anchor_pos}")
        T, L = max(lens), self.net.cfg.num_layers
        tokens = [batch[b].token_ids[-1] for b in idx]  # the anchors
        if len(slots) == 1:
            out = self._block_whole(slots[0], T, tokens[0])
            if out is not None:
                return out
        anchors = torch.tensor(tokens)
        emb = self.target.embed(anchors[:, None].to(self.target.info.device)).to(self.device, self.dtype)
        pos = torch.tensor(anchor_pos)[:, None] + torch.arange(self.net.cfg.block_size)  # [B', Bk]
        block = self.net.block_input(emb, self._mask_vector())[:, 0]  # [B', Bk, d]
        # One request reads views of the cache (no copies); several, one gather per layer.
        sl = slice(slots[0], slots[0] + 1) if len(slots) == 1 else torch.tensor(slots, device=self.device)
        ctx_kv = [(self.cache.k[i][sl, :, :T], self.cache.v[i][sl, :, :T]) for i in range(L)]
        visible = None  # [B', T]: every request sees its own committed rows
        if min(lens) < T:
            visible = (torch.arange(T)[None] < torch.tensor(lens)[:, None]).to(self.device)
        return self.net.draft_states(block, pos.to(self.device), ctx_kv, visible)

    def _mask_vector(self) -> torch.Tensor:
        """[d] what the mask slots read (`DFlash.mask_vector`, in the drafter's dtype), made once:
        the network and the target's embedding are frozen at inference."""
        if self._mask is None:
            mask = self.net.mask_vector(lambda ids: self.target.embed(ids.to(self.target.info.device)))
            self._mask = mask.detach().to(self.device, self.dtype)
        return self._mask

    def _block_whole(self, slot: int, T: int, anchor: int) -> torch.Tensor | None:
        """`draft_states` for one request whose block starts at the committed row T with the token
        `anchor`, every layer in one `kernels`' decode_layers call (decode_layer a layer, per-head
        q/k norms included: same math, its own rounding of RoPE and attention): the block's
        keys/values go to the cache rows past its T committed ones, which the next catch-up
        overwrites and nothing reads before. The block input is `block_input`'s [anchor embedding ;
        mask vector x (Bk - 1)]. None where the layers' products are not our kernels or the cache
        has no room for the block."""
        net, Bk = self.net, self.net.cfg.block_size
        R = self.cache.k[0].shape[2]
        if self.device.type != "cpu" or self.dtype != torch.float32 or T + Bk > R or net.norm.weight is None:
            return None
        if Bk not in self._whole:
            self._whole[Bk] = self._layers_args(Bk)
        if self._whole[Bk] is None:
            return None
        ws, ns, bs, norms = self._whole[Bk]
        emb = self.target.embed(torch.tensor([anchor]).to(self.target.info.device))  # [1, d]
        mask = self._mask_vector().expand(Bk - 1, -1)  # [Bk - 1, d]
        rows = torch.cat([emb.to(self.device, self.dtype), mask])  # [Bk, d] `block_input`'s rows
        c = net.cfg
        cs = signed_rope_rows(T, Bk, c.head_dim, c.rope_theta, self.device)  # [Bk, 2, D]
        kv = self.cache.kv[:, :, slot : slot + 1]  # [2, L, 1, Hk, R, D]
        dst, src = kv[:, :, :, :, T : T + Bk].transpose(3, 4), kv[:, :, :, :, : T + Bk]
        eps, H, Hk, D = c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim
        ops = kernels.fused()
        h = ops.decode_layers(rows, ws, ns, bs, cs, dst, src, None, eps, H, Hk, D, [], norms)[0]  # [Bk, d]
        return ops.rms_norm(h, net.norm.weight, norm_eps(net.norm))[None]  # FusedRMSNorm's call

    def _layers_args(self, Bk: int) -> tuple | None:
        """decode_layers' arguments for a block of Bk rows (weights, kinds and sizes, QKV biases,
        per-head q/k norms), or None where a layer's products are not all our kernels."""
        layers, norms = [], []
        for ly in self.net.layers:
            got = whole_layer_args(ly.attn, ly.mlp, ly.post_norm, Bk)
            if got is None:
                return None
            prods, qk = got
            layers.append((ly.input_norm.weight, prods))
            norms += [qk["q_norm"], qk["k_norm"]] if qk else []
        return (*formats.layers_args(layers), norms)

    # ---- propose --------------------------------------------------------------------------
    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """[B', K, d] final states -> [B', K, Vd] logits over the draft vocabulary."""
        return self.net.logits(states, self.head_w) if self.head is None else self.head(states)

    def _uniforms(self, batch, idx, num, j) -> torch.Tensor:
        """One uniform per request that drafts position j (exactly num[b] per request)."""
        return torch.stack(
            [
                torch.rand((), generator=batch[b].generator) if j < n else torch.zeros(())
                for b, n in zip(idx, num, strict=True)
            ]
        )

    def _uniform_rows(self, batch, idx, num, K) -> torch.Tensor:
        """[B', K]: `_uniforms` of positions 0..K-1 at once: request b's first num[b] drawn from
        its generator in one call (the same values, the generator left in the same state), zeros
        after."""
        u = torch.zeros(len(idx), K)
        for i, (b, n) in enumerate(zip(idx, num, strict=True)):
            if n > 0:
                u[i, :n] = torch.rand(n, generator=batch[b].generator)
        return u

    def _draft(self, batch, idx, states, num):
        """states [B', Bk, d] -> draft ids [B', K], q [B', K, Vd] (draft vocabulary; None when
        every request of the batch is greedy: the drafts are point masses), extras."""
        first = self.net.cfg.first_draft_slot
        K = max(num)
        params = [batch[b].params for b in idx]
        greedy, plain = self._plain(batch, params)
        whole = plain and self._head_op(states, len(idx) * K)
        if whole:  # head product and every slot's argmax or draw in one call
            u = None if greedy else self._uniform_rows(batch, idx, num, K)  # [B', K]
            t = 1.0 if greedy else params[0].temperature
            x, q = whole(states[:, first : first + K], u, t)  # [B', K], q [B', K, Vd] | [0]
            return self.vocab.to_target(x), None if greedy else q, num, {}
        small = self._logits(states[:, first : first + K])  # [B', K, Vd]
        if greedy:  # point masses at the argmax (q None)
            x, q = self.vocab.argmax(small), None  # [B', K]; no uniforms: nothing samples
        else:
            u = self._uniform_rows(batch, idx, num, K)  # [B', K]
            q = self.vocab.probs(small, params)  # [B', K, Vd]
            x = sample(q, u.to(q.device))
        return self.vocab.to_target(x).cpu(), q, num, {}

    def _plain(self, batch: list[DraftRow], params: list) -> tuple[bool, bool]:
        """(every request of the batch greedy, the drafting requests all greedy or at one plain
        temperature): whether a round's draws can run as one compiled call."""
        greedy, p0, Vd = all(row.params.greedy for row in batch), params[0], self.vocab.d2t.numel()
        return greedy, greedy or (all(p == p0 for p in params) and plain_temperature(p0, Vd))

    def _head_kernel(self, op: str, rows: int):
        """(`kernels`' op `op`, the head's kind, packed weight, outputs) where the extension has
        the op and the head of `rows` rows is one of our kernels without a bias; else None."""
        ops, head = kernels.fused(), None if self.head is None else self.head.product.ours(rows)
        if ops is None or not hasattr(ops, op) or head is None or head[3] is not None:
            return None
        return getattr(ops, op), *head[:3]

    def _head_op(self, states: torch.Tensor, rows: int):
        """`kernels`' head_rows for a round greedy or at one plain temperature, as (states
        [B', K, d], uniforms [B', K] | None, temperature) -> (draft ids [B', K], q [B', K, Vd] |
        [0]), where it applies (the extension built, fp32 states on the CPU, the head one of our
        kernels at `rows` rows; made once per number of rows); else None."""
        if states.device.type != "cpu" or states.dtype != torch.float32:
            return None
        if rows not in self._head_ops:
            got, op, off = self._head_kernel("head_rows", rows), None, self.vocab.off
            if got is not None:
                call, kind, packed, n_out = got

                def op(s, u, t):
                    return call(s, kind, packed, n_out, off, u, t)

            self._head_ops[rows] = op
        return self._head_ops[rows]

    _correction = None  # DSpark: draft ids [n] -> [n, Vd], the Markov head's term of the next slot

    def _children_op(self, U: torch.Tensor):
        """A compiled `children` for block_tree on these logits, or None (the torch ranking)."""
        return None

    def _anchor_draft_id(self, token: int) -> int:
        """The anchor as `_correction` reads it (unused without one)."""
        return 0

    @torch.no_grad()
    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        idx = [b for b, k in enumerate(num_draft) if k > 0]
        t0 = time.perf_counter()
        self._catch_up([batch[b].slot for b in idx])
        catch_up_s = time.perf_counter() - t0
        if not idx:
            return empty_proposal(len(batch))
        if self.tree is not None and self.tree.drafts_tree([batch[b].params for b in idx]):
            return self._propose_tree(batch, idx, num_draft, catch_up_s)
        num = [min(num_draft[b], self.net.cfg.num_drafts) for b in idx]
        states = self._block_states(batch, idx)
        ids, q, num, extras = self._draft(batch, idx, states, num)  # [B', K] ...
        draft_probs = None if q is None else q.float().cpu()  # [B', K, Vd] over self.vocab.d2t, or None
        n = torch.tensor(num)
        if len(idx) < len(batch):  # rows of the requests that draft -> rows of the whole batch
            sel = torch.tensor(idx)
            ids, n = _scatter_rows(ids, sel, len(batch)), _scatter_rows(n, sel, len(batch))
            draft_probs = None if draft_probs is None else _scatter_rows(draft_probs, sel, len(batch))
            extras = {key: _scatter_rows(val.cpu(), sel, len(batch)) for key, val in extras.items()}
        vocab = None if draft_probs is None else self.vocab.d2t
        return Proposal(ids, n, draft_probs, draft_vocab=vocab, extras=extras, catch_up_s=catch_up_s)

    def _propose_tree(self, batch: list[DraftRow], idx: list[int], num_draft: list[int], catch_up_s: float):
        """A round's trees for the requests `idx` (caught up; `block_tree`, one per request, up to
        its K nodes), with prompt lookup's branch joined by score when `tree.lookup`; point-mass
        candidates at any temperature (the tree is ranked by q at T = 1, whatever the request's
        sampling settings)."""
        first, n_slots = self.net.cfg.first_draft_slot, self.net.cfg.num_drafts
        U = self._logits(self._block_states(batch, idx)[:, first : first + n_slots]).float()  # [B', Bk, Vd]
        width = max(num_draft[b] for b in idx)
        draft_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, K]
        parents = torch.full((len(batch), width), -1, dtype=torch.long)  # [B, K]
        num = torch.zeros(len(batch), dtype=torch.long)
        children = self._children_op(U)
        for i, b in enumerate(idx):
            budget, prev = num_draft[b], self._anchor_draft_id(batch[b].token_ids[-1])
            ids, pars, scores, depths = block_tree(
                U[i], self._correction, self.vocab, prev, budget, self.tree.topk, children
            )
            toks = self.vocab.to_target(torch.tensor(ids, dtype=torch.long)).tolist()
            if self.tree.lookup:  # prompt lookup's branch joins by its score
                prefix, logp = lookup_prefix(batch[b].token_ids, budget)
                if prefix is not None:
                    toks, pars = join_by_score(
                        range(len(toks)), toks, pars, scores, depths, prefix, logp, budget
                    )
            draft_ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            parents[b, : len(toks)] = torch.tensor(pars, dtype=torch.long)
            num[b] = len(toks)
        return Proposal(draft_ids, num, parents=parents, tree_iid=False, catch_up_s=catch_up_s)

    # ---- advance --------------------------------------------------------------------------
    def advance(self, batch: list[DraftRow], proposal: Proposal, verdicts: list[Verdict], target_out) -> None:
        for b, row in enumerate(batch):
            kept = torch.tensor(verdicts[b].kept_rows)  # the anchor and the accepted drafts
            feats = self._features(target_out.hidden, b, kept)
            if feats is not None:
                self._pending.setdefault(row.slot, []).append(feats)


def _scatter_rows(x: torch.Tensor, sel: torch.Tensor, B: int) -> torch.Tensor:
    """x [B', ...] -> [B, ...]: x's rows at `sel`, zeros elsewhere."""
    out = x.new_zeros(B, *x.shape[1:])
    out[sel] = x
    return out
