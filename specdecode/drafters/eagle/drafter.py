"""EAGLE-3 drafting at inference: chain drafts, or EAGLE-2 dynamic trees.

Contract:
- `EagleDrafter(model, target, tree=None)` wraps a trained `Eagle3`. It captures the target's
  `feature_layers` during prefill and verification (`needs_hidden`) and keeps a one-layer KV
  cache per slot whose committed rows are built from real target features: row r holds
  (feature of position r, token r + 1) at RoPE position r + 1 (see model.py).
- `prefill` runs the prompt's features through the layer (prefill time); `advance` only queues
  the verified block's features of the kept rows (the accepted path);
  the next `propose` first runs them through the layer with the now-known next tokens
  (catch-up, one batched forward), which also yields the state the first draft comes from.
- Chain (`tree=None`): K drafts sampled left to right from the drafter's processed q (the
  request's temperature / top-k / top-p), processed and sampled in the draft vocabulary
  (`DraftVocab`); q goes to rejection sampling over the draft ids (`Proposal.draft_vocab`). Each
  later draft is one batched forward of one row per request that attends to the committed
  rows and the request's earlier draft rows (written past the committed length, never
  committed). When every request of the batch is greedy, each draft is the argmax and the
  proposal carries point masses (`draft_probs` None: what temperature 0 processing gives, and
  all greedy verification reads) without the processing. A greedy round of one request on
  CPU whose products are our kernels runs the whole chain in one compiled call
  (`kernels`' eagle_chain: the loop's functions in its order, so the same drafts).
- Tree (`tree=TreeSpec(depth, topk, num_nodes)`): EAGLE-2. Expand the `topk` children of each of
  the `topk` best frontier nodes by cumulative log-probability for `depth` levels, then keep the
  `num_nodes` best nodes overall (a node's ancestors always rank above it, so the kept set is a
  tree) and hand them over with parent indices. A round asked for K < `num_nodes` keeps K and
  grows at most K levels (no deeper node could be kept). Siblings are chosen deterministically, so the
  loop verifies them as point-mass candidates (lossless at any temperature). Near-ties in the
  ranking can resolve differently in a batch than alone (float rounding): a seed may then give
  another sample, but the output distribution is the target's either way. A round where a request
  of the batch samples (T > 0) drafts sampled chains of at most `depth` drafts instead
  (`TreeSpec.when_sampling="chain"`, the default): a point-mass candidate is accepted with the
  target's probability of it, a draft sampled from q with 1 - TV(p, q), so at T = 1 the chain
  keeps more (on the AMX kind EAGLE-3's chain ran 1.31x where the tree ran 1.08x); "tree" keeps
  trees at every temperature.
Legend: B requests, K drafts, d width, Vd draft vocab, V target vocab rows, S slots, R cache rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafter import Drafter, DraftRow, Proposal, empty_proposal, gather_features, prompt_row
from specdecode.drafters.eagle.model import Eagle3
from specdecode.drafters.layers import (
    DraftVocab,
    attend,
    layer_call,
    rope_table,
    signed_rope,
    signed_rope_table,
    whole_layer_args,
)
from specdecode.drafters.ngram import lookup_prefix
from specdecode.models import kernels
from specdecode.models.kv_cache import KVCache
from specdecode.sampling import plain_temperature, sample
from specdecode.tree import join_by_score
from specdecode.verify import Verdict


@dataclass(frozen=True)
class TreeSpec:
    depth: int = 5
    topk: int = 4
    num_nodes: int = 16
    when_sampling: str = "chain"  # a round with a T > 0 request: "chain" (<= depth drafts) or "tree"
    lookup: bool = False  # greedy trees: the continuation of the latest n-gram match joins by its score

    def __post_init__(self):
        if self.when_sampling not in ("chain", "tree"):
            raise ValueError(f"when_sampling must be 'chain' or 'tree', got {self.when_sampling!r}")


class EagleDrafter(Drafter):
    name = "eagle"
    deterministic = False

    def __init__(self, model: Eagle3, target, tree: TreeSpec | None = None, cost_per_token: float = 0.1):
        self.net = model.eval()
        self.target = target.model
        self.vocab_size = target.vocab_size  # tokenizer size: ids past it never drafted
        self.layers = tuple(model.cfg.feature_layers)  # low, mid, high (a tiny target may repeat one)
        self.needs_hidden = tuple(dict.fromkeys(self.layers))
        self.tree = tree
        self.deterministic = tree is not None
        self.cost_points = (tree.depth,) if tree else ()  # a tree of K nodes grows min(K, depth) levels
        if tree is not None and tree.when_sampling == "chain":  # sampled rounds: a chain <= depth
            self.sampled_k_max = tree.depth
        self.cost_per_token = cost_per_token
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.vocab = DraftVocab(model.d2t.to(self.device), self.vocab_size)
        self.cache: KVCache | None = None
        self._pending: dict[int, list[torch.Tensor]] = {}  # slot -> queued [n, 3d] features
        self._last: dict[int, torch.Tensor] = {}  # slot -> [d] output state of the last committed row
        self._whole: dict[int, tuple | None] = {}  # rows -> decode_layer's product arguments
        self._chain_spec: tuple | None | bool = False  # eagle_chain's arguments (False: not looked up)

    # ---- slots ----------------------------------------------------------------------------
    def setup(self, num_slots: int, max_len: int) -> None:
        c = self.net.cfg
        extra = 2 * max(self.tree.num_nodes if self.tree else 0, 64)  # draft rows past the committed ones
        self.cache = KVCache(
            1, num_slots, max_len + extra, c.num_kv_heads, c.head_dim, self.dtype, self.device
        )

    def start(self, slot: int, prompt_ids: list[int], hidden: dict | None = None) -> None:
        self.cache.reset(slot)
        self._last.pop(slot, None)
        feats = self._features(hidden, None) if hidden else None
        self._pending[slot] = [feats] if feats is not None and feats.shape[0] else []

    def prefill(self, slot: int, prompt_ids: list[int]) -> None:
        self._catch_up([prompt_row(slot, prompt_ids)], [0])  # the prompt's rows through the layer

    def stop(self, slot: int) -> None:
        self._pending.pop(slot, None)
        self._last.pop(slot, None)

    def _features(self, hidden: dict, b: int | None, rows=None) -> torch.Tensor:
        """Concatenate the captured layers (low ; mid ; high) -> [n, 3d] in the drafter dtype."""
        x = gather_features(hidden, self.layers, b, rows)
        return None if x is None else x.to(self.device, self.dtype)

    # ---- the layer over cached rows -------------------------------------------------------
    @torch.no_grad()
    def _run(self, slots, tok, hidden, rows, positions, visible):
        """One layer pass. tok [B, N] ids, hidden [B, N, d], rows [B, N] cache rows written,
        positions [B, N], visible [B, N, span] bool, or None when every query of one request
        sees rows 0..span-1 (span = its last written row + 1) -> output states [B, N, d]."""
        c = self.net.cfg
        emb = self.target.embed(tok.to(self.target.info.device)).to(self.device, self.dtype)
        cos, sin = rope_table(positions.to(self.device), c.head_dim, c.rope_theta)
        if len(slots) == 1:  # one request's rows r0..r0+N-1: one call
            out = self._run_whole(slots[0], emb, hidden, rows, cos, sin, visible)
            if out is not None:
                return out
        q, k, v = self.net.attn.qkv(self.net.layer_in(emb, hidden), cos, sin)
        sl = torch.tensor(slots, device=self.device)[:, None]  # [B, 1]
        kc = self.cache.k[0].transpose(1, 2)  # [S, R, Hk, D] view
        vc = self.cache.v[0].transpose(1, 2)
        kc[sl, rows.to(self.device)] = k
        vc[sl, rows.to(self.device)] = v
        if len(slots) == 1:  # one request: views of its rows, no gather
            s = slots[0]
            span = int(rows.max()) + 1 if visible is None else visible.shape[-1]
            keys, values = kc[s : s + 1, :span], vc[s : s + 1, :span]  # [1, span, Hk, D]
        else:
            span = visible.shape[-1]
            keys, values = kc[sl[:, 0], :span], vc[sl[:, 0], :span]  # [B, span, Hk, D]
        mask = None if visible is None else visible.to(self.device)
        return self.net.layer_out(hidden, attend(q, keys, values, mask))

    def _run_whole(self, slot, emb, hidden, rows, cos, sin, visible=None) -> torch.Tensor | None:
        """`_run` for one request whose N new rows are consecutive, as `kernels`' decode_layer
        (same math, one call; its own rounding of RoPE and attention), when the layer's products
        are our kernels; else None. emb, hidden [1, N, d]; rows [1, N]; cos/sin [1, N, D];
        visible [1, N, r0 + N] (catch-up: causal) or None (every row sees rows 0..r0+N-1)."""
        net, N = self.net, rows.shape[1]
        r0 = int(rows[0, 0])
        if self.device.type != "cpu" or self.dtype != torch.float32 or int(rows[0, -1]) != r0 + N - 1:
            return None
        if visible is not None and visible.shape[-1] != r0 + N:
            return None
        if N not in self._whole:
            self._whole[N] = whole_layer_args(net.attn, net.mlp, net.post_norm, N)
        if self._whole[N] is None:
            return None
        k, v = self.cache.k[0][slot : slot + 1], self.cache.v[0][slot : slot + 1]  # [1, Hk, R, D]
        d, cs = hidden.shape[-1], signed_rope(cos, sin).reshape(N, 2, -1)
        vis = None if visible is None else visible[0].to(self.device)  # [N, r0 + N]
        out = layer_call(
            hidden.reshape(N, d), net.post_norm.weight, self._whole[N], cs, k, v, r0, net.cfg, vis,
            qkv_in=net.layer_in(emb, hidden).reshape(N, -1),
        )  # fmt: skip
        return out.view(1, N, d)

    @torch.no_grad()
    def _catch_up(self, batch: list[DraftRow], idx: list[int]) -> None:
        """Run queued target features through the layer and commit them (ragged, one forward)."""
        todo = [b for b in idx if self._pending.get(batch[b].slot)]
        if not todo:
            return
        feats = [torch.cat(self._pending[batch[b].slot]) for b in todo]  # [n_b, 3d]
        n = max(f.shape[0] for f in feats)
        B = len(todo)
        lens = torch.tensor([self.cache.lengths[batch[b].slot] for b in todo])  # [B]
        x = torch.zeros(B, n, feats[0].shape[-1], dtype=self.dtype, device=self.device)
        tok = torch.zeros(B, n, dtype=torch.long)
        counts = torch.tensor([f.shape[0] for f in feats])
        for i, (b, f) in enumerate(zip(todo, feats, strict=True)):
            x[i, : f.shape[0]] = f
            start = int(lens[i]) + 1  # row r reads token r + 1
            tok[i, : f.shape[0]] = torch.tensor(batch[b].token_ids[start : start + f.shape[0]])
        j = torch.arange(n)
        rows = lens[:, None] + j[None]  # [B, n]
        valid = j[None] < counts[:, None]  # [B, n]
        rows = torch.where(valid, rows, torch.full_like(rows, self.cache.scratch_row))
        span = int((lens + counts).max())
        col = torch.arange(span)
        visible = col[None, None] <= rows[:, :, None]  # causal over committed + new rows
        visible = visible | ~valid[:, :, None]  # padded queries see everything (discarded)
        out = self._run([batch[b].slot for b in todo], tok, self.net.fuse(x), rows, rows + 1, visible)
        for i, b in enumerate(todo):
            slot = batch[b].slot
            self.cache.commit(slot, int(counts[i]))
            self._last[slot] = out[i, int(counts[i]) - 1]
            self._pending[slot] = []

    def _chain_args(self) -> tuple | None:
        """decode_layer's product arguments and the head's product for `kernels`' eagle_chain,
        when every piece of a greedy chain step runs our compiled kernels; else None."""
        if self._chain_spec is False:
            net, ops = self.net, kernels.fused()
            layer = self._whole.setdefault(1, whole_layer_args(net.attn, net.mlp, net.post_norm, 1))
            head = getattr(getattr(net.head, "product", None), "ours", lambda rows: None)(1)
            native = hasattr(self.target, "embed_tokens")
            ok = ops is not None and hasattr(ops, "eagle_chain") and layer is not None and native
            ok = ok and head is not None and head[3] is None and self.device.type == "cpu"
            self._chain_spec = (layer, head[:3]) if ok and self.dtype == torch.float32 else None
        return self._chain_spec

    def _chain(self, chain: tuple, slot: int, state: torch.Tensor, base: int, k: int, sampled=None):
        """K draft ids [K] of one request from its last state [1, d]: greedy (eagle_chain), or with
        `sampled` = (uniforms [K], temperature) drawn at that temperature, returning also their
        distributions over the draft vocabulary [K, Vd] (eagle_chain_sampled)."""
        (args, norms), head = chain
        net, c, ops = self.net, self.net.cfg, kernels.fused()
        positions = torch.arange(base + 1, base + k)[None]  # [1, K - 1] positions of drafts 0..K-2
        cs = signed_rope_table(positions, c.head_dim, c.rope_theta)[0]  # [K - 1, 2, D]
        common = (
            state, k, *head, net.norm.weight, self.vocab.off, self.vocab.d2t, self.target.embed_tokens,
            net.input_norm.weight, net.hidden_norm.weight, *args, cs,
            self.cache.k[0][slot : slot + 1], self.cache.v[0][slot : slot + 1], base, c.rms_norm_eps,
            c.num_heads, c.num_kv_heads, c.head_dim,
        )  # fmt: skip
        if sampled is None:
            return ops.eagle_chain(*common, **norms)
        return ops.eagle_chain_sampled(*common, *sampled, **norms)

    # ---- propose --------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, batch: list[DraftRow], num_draft: list[int]) -> Proposal:
        idx = [b for b, k in enumerate(num_draft) if k > 0]
        self._catch_up(batch, idx)
        idx = [b for b in idx if batch[b].slot in self._last]  # a 1-token prompt has no state yet
        if not idx:
            return empty_proposal(len(batch))
        if self.tree is not None:
            if self.tree.when_sampling == "tree" or all(batch[b].params.greedy for b in idx):
                return self._propose_tree(batch, idx, num_draft)
            num_draft = [min(k, self.tree.depth) for k in num_draft]  # a sampled chain instead
        max_k = max(num_draft[b] for b in idx)
        slots = [batch[b].slot for b in idx]
        params = [batch[b].params for b in idx]
        greedy = all(row.params.greedy for row in batch)  # point masses, no q
        base = torch.tensor([self.cache.lengths[s] for s in slots])  # [B']
        state = torch.stack([self._last[s] for s in slots])  # [B', d]
        xs, qs = [], []  # per draft position: [B'] target ids, [B', Vd] q
        # One request's whole chain in one compiled call: greedy, or sampled at a plain temperature
        # (no top-k / top-p) with the uniforms the loop below would draw, in the same order.
        # (A greedy request beside sampled ones in the batch drafts in the loop.)
        plain = greedy or plain_temperature(params[0], self.vocab.d2t.numel())
        chain = self._chain_args() if plain and len(idx) == 1 else None  # both ops: one extension
        if chain is not None and greedy:
            xs = list(self.vocab.to_target(self._chain(chain, slots[0], state, int(base[0]), max_k))[:, None])
        elif chain is not None:
            g = batch[idx[0]].generator
            u = torch.stack([torch.rand((), generator=g) for _ in range(max_k)])  # [K]
            ids, q = self._chain(chain, slots[0], state, int(base[0]), max_k, (u, params[0].temperature))
            xs = list(self.vocab.to_target(ids)[:, None])  # K x [1]
            qs = list(q.to(self.device)[:, None])  # K x [1, Vd]
        for j in range(0 if chain is not None else max_k):
            small = self.net.logits(state)  # [B', Vd]
            if greedy:  # the point mass at the argmax: what temperature 0 processing gives
                xd = self.vocab.argmax(small)
            else:
                u = torch.stack(
                    [
                        torch.rand((), generator=batch[b].generator) if j < num_draft[b] else torch.zeros(())
                        for b in idx
                    ]
                )  # exactly num_draft[b] uniforms per request
                q = self.vocab.probs(small[:, None], params)[:, 0]  # [B', Vd]
                xd = sample(q, u.to(q.device))  # [B'] draft ids
                qs.append(q)
            x = self.vocab.to_target(xd)  # [B'] target ids
            xs.append(x)
            if j + 1 < max_k:  # feed draft j at row base + j (uncommitted), position base + j + 1
                rows = (base + j)[:, None]  # [B', 1]
                visible = None  # one request sees all its rows up to this one
                if len(idx) > 1:
                    col = torch.arange(int(base.max()) + j + 1)
                    visible = col[None, None] <= rows[:, :, None]  # committed rows + earlier drafts
                state = self._run(slots, x[:, None].cpu(), state[:, None], rows, rows + 1, visible)[:, 0]
        sel = torch.tensor(idx)
        draft_ids = torch.zeros(len(batch), max_k, dtype=torch.long)  # [B, K]
        draft_ids[sel] = torch.stack(xs, 1).cpu()
        draft_probs = vocab = None  # greedy rounds: point masses
        if qs:
            q = torch.stack(qs, 1).float().cpu()  # [B', K, Vd] over the draft vocabulary's target ids
            draft_probs, vocab = q.new_zeros(len(batch), max_k, q.shape[-1]), self.vocab.d2t
            draft_probs[sel] = q
        num = torch.tensor([max(k, 0) if b in idx else 0 for b, k in enumerate(num_draft)])
        return Proposal(draft_ids=draft_ids, num_draft=num, draft_probs=draft_probs, draft_vocab=vocab)

    def _propose_tree(self, batch: list[DraftRow], idx: list[int], num_draft: list[int]) -> Proposal:
        """EAGLE-2 dynamic tree, one request at a time (trees differ in shape per request)."""
        spec = self.tree
        width = max(min(spec.num_nodes, num_draft[b]) for b in idx)
        draft_ids = torch.zeros(len(batch), width, dtype=torch.long)
        parents = torch.full((len(batch), width), -1, dtype=torch.long)
        num = torch.zeros(len(batch), dtype=torch.long)
        for b in idx:
            budget = min(spec.num_nodes, num_draft[b])
            prefix, logp = None, 0.0
            if spec.lookup:  # prompt lookup's branch: free to draft, point masses like the tree's
                prefix, logp = lookup_prefix(batch[b].token_ids, budget)
            toks, pars = self._grow_tree(batch[b], budget, prefix=prefix, prefix_logp=logp)
            n = len(toks)
            draft_ids[b, :n] = torch.tensor(toks)
            parents[b, :n] = torch.tensor(pars)
            num[b] = n
        return Proposal(draft_ids=draft_ids, num_draft=num, parents=parents, tree_iid=False)

    def _grow_tree(
        self, row: DraftRow, budget: int, levels: int | None = None, prefix=None, prefix_logp: float = 0.0
    ) -> tuple[list[int], list[int]]:
        """The `budget` best nodes of a tree grown `levels` deep (default: min(depth, budget),
        as deep as a kept node can be) -> (tokens, parent positions). With a `prefix` (a chain of
        tokens: prompt lookup's continuation), its j-th token scores j * `prefix_logp` and joins the
        tree's nodes best first, sharing a node where both hold the same token after the same
        parent, until the budget is spent."""
        spec, slot = self.tree, row.slot
        levels = min(spec.depth, budget) if levels is None else levels
        base = self.cache.lengths[slot]
        # Per node: token, parent (-1 = the last committed token), cumulative log-prob, depth.
        toks, pars, scores, depths = [], [], [], []
        rows_of: dict[int, int] = {}  # node -> draft cache row
        out_of: dict[int, torch.Tensor] = {}  # node -> its output state [d]

        def expand(parents: list[int], states: torch.Tensor) -> list[int]:
            """The `topk` children of each parent (states [F, d], one head product) -> new nodes."""
            top = self.vocab.log_probs(self.net.logits(states)).topk(spec.topk, dim=-1)  # [F, topk]
            ids = self.vocab.to_target(top.indices).tolist()
            for parent, vals, tids in zip(parents, top.values.tolist(), ids, strict=True):
                for s, t in zip(vals, tids, strict=True):
                    toks.append(t)
                    pars.append(parent)
                    scores.append((scores[parent] if parent >= 0 else 0.0) + s)
                    depths.append(depths[parent] + 1 if parent >= 0 else 1)
            return list(range(len(toks) - spec.topk * len(parents), len(toks)))

        frontier = expand([-1], self._last[slot][None])
        next_row = base
        for _ in range(levels - 1):
            # 1. Run the best `topk` frontier nodes through the layer (one forward).
            frontier = sorted(frontier, key=lambda i: -scores[i])[: spec.topk]
            for i in frontier:
                rows_of[i] = next_row
                next_row += 1
            visible = torch.zeros(1, len(frontier), next_row, dtype=torch.bool)  # [1, F, span]
            visible[0, :, :base] = True
            queries, cols = [], []  # a node sees its own row and its ancestors' rows
            for qi, i in enumerate(frontier):
                a = i
                while a >= 0:
                    queries.append(qi)
                    cols.append(rows_of[a])
                    a = pars[a]
            visible[0, queries, cols] = True
            states = torch.stack([self._last[slot] if pars[i] < 0 else out_of[pars[i]] for i in frontier])
            out = self._run(
                [slot],
                torch.tensor([[toks[i] for i in frontier]]),
                states[None],  # [1, F, d]
                torch.tensor([[rows_of[i] for i in frontier]]),
                torch.tensor([[base + depths[i] for i in frontier]]),
                visible,
            )[0]  # [F, d]
            # 2. Expand: topk children of each (one head product), scored by cumulative log-probability.
            for qi, i in enumerate(frontier):
                out_of[i] = out[qi]
            frontier = expand(frontier, out)
        # 3. Rerank all nodes and keep the best `budget`; ancestors score at least as high as
        #    their descendants, so the kept set is a tree. Order parents before children.
        best = sorted(range(len(toks)), key=lambda i: (-scores[i], depths[i]))[:budget]
        if prefix is not None and len(prefix):  # the prefix's j-th token scores j * prefix_logp
            return join_by_score(best, toks, pars, scores, depths, prefix, prefix_logp, budget)
        keep = sorted(best, key=lambda i: (depths[i], i))
        pos_of = {i: p for p, i in enumerate(keep)}
        return [toks[i] for i in keep], [pos_of[pars[i]] if pars[i] >= 0 else -1 for i in keep]

    # ---- advance --------------------------------------------------------------------------
    def advance(self, batch: list[DraftRow], proposal: Proposal, verdicts: list[Verdict], target_out) -> None:
        for b, row in enumerate(batch):
            kept = torch.tensor(verdicts[b].kept_rows)  # the anchor and the accepted path's rows
            feats = self._features(target_out.hidden, b, kept)
            self._pending.setdefault(row.slot, []).append(feats)
