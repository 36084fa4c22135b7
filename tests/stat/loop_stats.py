"""Helpers for the loop-level distribution tests (tests/stat/test_loop_distribution.py).

Contract:
- `write_peaked(src, dst, support, ...)` turns a tiny random qwen2 directory (untied head) into a
  target whose next-token law is concentrated on a few `support` tokens (mean logits `bias`,
  every other token's `tail`) but depends strongly on the context, and writes it to `dst`.
  Residual coordinate 0 carries a constant that no layer reads or writes, so the final normed
  state has a nearly constant coordinate 0 through which head column 0 acts as a per-token bias
  (calibrated on random contexts); the other coordinates keep the random network's context
  dependence.
  `noise > 0` also perturbs every layer matrix and `sharpen` scales the logits: "the target plus
  controlled noise", a draft model that is accepted often but not always.
- `exact_law(model, prompt, params, depth, min_prob)`: the exact probability of every
  `depth`-token continuation whose probability is >= min_prob, computed with the transformers
  implementation of the target (independent of the native model and the decoding loop) and a
  reference temperature / top-p processing written here.
- `chi_square(counts, law, n)`: scipy.stats.chisquare of observed continuation counts against
  the exact expected counts; cells with expected < 5 are merged into one bin.
- `VerifierSpy` wraps the verification functions the loop calls (the names in
  specdecode.verify, our CPU kernel's `native_chain` and `native_tree` among them) and counts accepted drafts,
  recovered tokens (first rejection) and bonus
  tokens (every draft accepted); `broken` makes it re-draw the token after a rejection from the
  target's p instead of the residual, the classic losslessness bug.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from scipy.stats import chisquare

import specdecode.verify as verify_mod
from specdecode.sampling import process_logits_batch


# ---- a peaked target ----------------------------------------------------------------------------
@torch.no_grad()
def write_peaked(
    src,
    dst,
    support: list[int],
    bias: tuple[float, ...] = (2.0, 0.8, 0.3, -0.2),
    const: float = 4.0,
    tail: float = -7.0,
    support_scale: float = 3.0,
    tail_scale: float = 0.5,
    noise: float = 0.0,
    sharpen: float = 1.0,
    seed: int = 0,
):
    """See the module docstring; bias/tail are logits (in units of the final state's coordinate 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    sd = model.state_dict()
    sd["model.embed_tokens.weight"][:, 0] = const
    for name, w in sd.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[0, :] = 0.0  # no layer writes coordinate 0 ...
        if name.endswith("layernorm.weight"):
            w[0] = 0.0  # ... and none reads it
    sd["model.norm.weight"][0] = 1.0
    head = sd["lm_head.weight"]  # [V, d]
    head[:, 1:] *= tail_scale
    ids = torch.tensor(support)
    head[ids, 1:] *= support_scale / tail_scale
    # Calibrate column 0 on random contexts of support tokens: mean logit = bias (support) / tail.
    head[:, 0] = 0.0
    g = torch.Generator().manual_seed(0)
    ctx = ids[torch.randint(0, len(support), (32, 12), generator=g)]
    h = model.model(ctx).last_hidden_state  # [32, 12, d] final normed states
    n0 = float(h[..., 0].mean())  # the ~constant coordinate 0
    want = torch.full((head.shape[0],), tail)
    want[ids] = torch.tensor(bias[: len(support)])
    head[:, 0] = (want - (h @ head.T).mean((0, 1))) / n0
    if noise > 0:
        gn = torch.Generator().manual_seed(seed)
        for name, w in sd.items():
            if ".layers." in name and w.dim() == 2:
                w.add_(noise * w.std() * torch.randn(w.shape, generator=gn))
    head *= sharpen
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


# ---- the exact law --------------------------------------------------------------------------------
def reference_probs(logits: torch.Tensor, temperature: float, top_p: float, vocab_size: int):
    """[N, V'] logits -> ([N, vocab_size] float64 processed probabilities, smallest top-p margin)."""
    p = torch.softmax(logits[:, :vocab_size].double() / temperature, dim=-1)
    if top_p >= 1.0:
        return p, float("inf")
    vals, idx = p.sort(dim=-1, descending=True)
    before = vals.cumsum(-1) - vals  # mass strictly before each id
    keep = before < top_p
    margin = float((before - top_p).abs().min())  # how close a cut came to flipping
    kept = torch.where(keep, vals, torch.zeros_like(vals))
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(p).scatter_(-1, idx, kept), margin


@torch.no_grad()
def exact_law(model, prompt: list[int], params, vocab_size: int, depth: int, min_prob: float):
    """{continuation (tuple of `depth` ids): probability} for every continuation >= min_prob
    (its prefixes are then >= min_prob too, so pruning smaller prefixes loses none), and the
    smallest top-p margin met on the way."""
    frontier, margin = {(): 1.0}, float("inf")
    for _ in range(depth):
        prefixes = list(frontier)
        batch = torch.tensor([prompt + list(pre) for pre in prefixes])  # [N, P + level]
        logits = model(batch).logits[:, -1].double()  # [N, V']
        probs, m = reference_probs(logits, params.temperature, params.top_p, vocab_size)
        margin = min(margin, m)
        nxt = {}
        for pre, row in zip(prefixes, probs, strict=True):
            joint = frontier[pre] * row
            for t in torch.nonzero(joint >= min_prob)[:, 0].tolist():
                nxt[pre + (t,)] = float(joint[t])
        frontier = nxt
    return frontier, margin


def chi_square(counts: dict, law: dict, n: int):
    """(p-value, number of bins) of the observed continuation counts against n x law."""
    obs, exp, rest_obs, rest_exp = [], [], float(n), float(n)
    for cell, prob in law.items():
        e = n * prob
        if e >= 5:
            obs.append(float(counts.get(cell, 0)))
            exp.append(e)
            rest_obs -= obs[-1]
            rest_exp -= e
    if rest_exp >= 5 or not exp:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:  # the remainder is itself sparse: merge it into the smallest cell
        i = min(range(len(exp)), key=exp.__getitem__)
        obs[i] += rest_obs
        exp[i] += rest_exp
    return float(chisquare(obs, exp).pvalue), len(exp)


# ---- spying on (and breaking) the verifier --------------------------------------------------------
def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of [.., V] probs with uniforms [..] (test-local, never an id of mass 0)."""
    cdf = probs.double().cumsum(-1)
    x = (u.double() * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@dataclass
class VerifierSpy:
    """Counts verifier outcomes; with `broken`, recovered tokens come from p, not the residual."""

    broken: bool = False
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    plain: int = 0  # steps without drafts (the token is a plain sample)
    calls: int = 0  # verifier calls seen (0: the loop no longer calls the names patched here)
    native: int = 0  # of them, chains and trees verified by our CPU kernel (verify_native)
    multi: int = 0  # steps that accepted two drafts or more
    drafts: collections.Counter = field(default_factory=collections.Counter)  # drafts per step -> steps
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1234))

    def install(self, monkeypatch) -> VerifierSpy:
        monkeypatch.setattr(verify_mod, "verify_chain", self._chain(verify_mod.verify_chain))
        monkeypatch.setattr(verify_mod, "verify_chain_block", self._chain(verify_mod.verify_chain_block))
        monkeypatch.setattr(verify_mod, "verify_chain_match", self._match(verify_mod.verify_chain_match))
        monkeypatch.setattr(verify_mod, "verify_tree_batch", self._tree(verify_mod.verify_tree_batch))
        monkeypatch.setattr(verify_mod, "native_chain", self._native(verify_mod.native_chain))
        monkeypatch.setattr(verify_mod, "native_tree", self._native_tree(verify_mod.native_tree))
        return self

    def summary(self) -> str:
        return (
            f"accepted={self.accepted} recovered={self.recovered} bonus={self.bonus} plain={self.plain} "
            f"native={self.native} "
            f"multi={self.multi} drafts/step={dict(sorted(self.drafts.items()))}"
        )

    def _tally_chain(self, v, num_draft, K: int, target_probs) -> None:
        self.calls += 1
        nd = torch.full_like(v.num_accepted, K) if num_draft is None else num_draft.to(v.num_accepted)
        acc = v.num_accepted
        self.accepted += int(acc.sum())
        self.multi += int((acc >= 2).sum())
        self.drafts.update(nd.tolist())
        self.plain += int((nd == 0).sum())
        self.bonus += int(((acc == nd) & (nd > 0)).sum())
        rejected = acc < nd
        self.recovered += int(rejected.sum())
        if self.broken and bool(rejected.any()):
            rows = torch.nonzero(rejected)[:, 0]
            p = target_probs[rows, acc[rows]]  # [R, V] the target's own p at the rejected row
            u = torch.rand(len(rows), generator=self.gen)
            v.emitted_ids[rows, acc[rows]] = _draw(p, u).to(v.emitted_ids)

    def _chain(self, real):
        def verify_chain(draft_ids, draft_probs, target_probs, uniforms, num_draft=None):  # or _block
            v = real(draft_ids, draft_probs, target_probs, uniforms, num_draft)
            self._tally_chain(v, num_draft, draft_ids.shape[1], target_probs)
            return v

        return verify_chain

    def _match(self, real):
        def verify_chain_match(draft_ids, target_probs, uniforms, num_draft=None):
            v = real(draft_ids, target_probs, uniforms, num_draft)
            self._tally_chain(v, num_draft, draft_ids.shape[1], target_probs)
            return v

        return verify_chain_match

    def _native(self, real):
        # our CPU kernel's chains (verify_native): the same tally, and the same broken re-draw
        def native_chain(
            logits, draft_ids, num_draft, q, uniforms, params, vocab_size, q_ids=None, block=False
        ):
            got = real(logits, draft_ids, num_draft, q, uniforms, params, vocab_size, q_ids, block)
            if got is None:
                return None  # the loop takes the tensor path, spied above
            acc, final = got
            self.native += 1
            B, K = draft_ids.shape
            v = verify_mod.ChainVerdict(acc, torch.full((B, K + 1), -1, dtype=torch.long), acc + 1)
            v.emitted_ids[torch.arange(B), acc] = final
            p = process_logits_batch(logits, list(params), vocab_size) if self.broken else None
            self._tally_chain(v, num_draft, K, p)
            return acc, v.emitted_ids[torch.arange(B), acc]

        return native_chain

    def _tally_tree(self, par, tree_ids, num_accepted, accepted_nodes, emitted_ids, target_probs) -> None:
        """par [B, N]; a broken verifier draws the token after a rejection from the target's own p
        at the last node (not from p without the rejected children)."""
        self.calls += 1
        for b in range(tree_ids.shape[0]):
            n, a = int((tree_ids[b] >= 0).sum()), int(num_accepted[b])
            self.accepted += a
            self.multi += a >= 2
            self.drafts[n] += 1
            if n == 0:
                self.plain += 1
                continue
            last = int(accepted_nodes[b, a - 1]) if a else -1
            if bool((par[b, :n] == last).any()):  # children of the last node were all rejected
                self.recovered += 1
                if self.broken:
                    u = torch.rand(1, generator=self.gen)
                    p = target_probs[b, last + 1][None]
                    emitted_ids[b, a] = _draw(p, u)[0].to(emitted_ids)
            else:
                self.bonus += 1  # a leaf was accepted: the final token is a bonus

    def _tree(self, real):
        def verify_tree_batch(parents, tree_ids, draft_probs, target_probs, uniforms, iid):
            v = real(parents, tree_ids, draft_probs, target_probs, uniforms, iid)
            par = parents if parents.dim() == 2 else parents[None].expand(tree_ids.shape[0], -1)
            self._tally_tree(par, tree_ids, v.num_accepted, v.accepted_nodes, v.emitted_ids, target_probs)
            return v

        return verify_tree_batch

    def _native_tree(self, real):
        # our CPU kernel's trees of point-mass candidates: the same tally and broken re-draw
        def native_tree(logits, tree_ids, parents, uniforms, params, vocab_size):
            got = real(logits, tree_ids, parents, uniforms, params, vocab_size)
            if got is None:
                return None  # the loop takes the tensor path, spied above
            path, final = got
            self.native += 1
            acc = (path >= 0).sum(1)  # [B]
            emitted = torch.full((path.shape[0], path.shape[1] + 1), -1, dtype=torch.long)
            emitted[torch.arange(path.shape[0]), acc] = final
            p = process_logits_batch(logits, list(params), vocab_size) if self.broken else None
            self._tally_tree(parents, tree_ids, acc, path, emitted, p)
            return path, emitted[torch.arange(path.shape[0]), acc]

        return native_tree
