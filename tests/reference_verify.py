"""Slow, obviously-correct reference implementations for the sampling / verification tests.

Contract: straightforward per-row Python loops (float64 Python numbers) that implement the same
spec and the same uniform layout as `specdecode.sampling` / `specdecode.verify`, so the fast
vectorised code can be compared to them with identical uniforms. Test-only code.
"""

from __future__ import annotations

import math

import torch

from specdecode.config import SamplingParams


def ref_process_logits(
    logits: list[float], params: SamplingParams, vocab_size: int | None = None
) -> list[float]:
    """One row: mask padded ids, temperature, top-k, top-p, renormalise."""
    V = len(logits)
    n = V if vocab_size is None else min(vocab_size, V)
    ids = list(range(n))
    if params.temperature == 0:
        best = max(ids, key=lambda i: (logits[i], -i))  # first maximum, like torch.argmax
        return [1.0 if i == best else 0.0 for i in range(V)]
    scaled = {i: logits[i] / params.temperature for i in ids}
    ids.sort(key=lambda i: -scaled[i])
    if params.top_k > 0:
        ids = ids[: params.top_k]
    m = max(scaled[i] for i in ids)
    weights = {i: math.exp(scaled[i] - m) for i in ids}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if params.top_p < 1.0:
        kept, mass = [], 0.0
        for i in ids:  # most likely first; stop once the kept mass reaches top_p
            if mass >= params.top_p:
                break
            kept.append(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(V)]


def ref_sample(probs: list[float], u: float) -> int:
    """Inverse CDF: the first id whose cumulative mass exceeds u * total."""
    target = u * sum(probs)
    acc = 0.0
    for i, x in enumerate(probs):
        acc += x
        if x > 0 and target < acc:
            return i
    return max(i for i, x in enumerate(probs) if x > 0)


def _residual(p: list[float], q: list[float]) -> list[float]:
    """norm(max(0, p - q)), or p itself when that has no mass."""
    r = [max(0.0, a - b) for a, b in zip(p, q, strict=True)]
    s = sum(r)
    return p if s <= 0 else [x / s for x in r]


def _one_hot(x: int, V: int) -> list[float]:
    return [float(i == x) for i in range(V)]


def ref_verify_chain(draft_ids, draft_probs, target_probs, uniforms, num_draft=None):
    """Returns (num_accepted per row, emitted tokens per row)."""
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    out_n, out_emitted = [], []
    for b in range(B):
        n_b = K if num_draft is None else int(num_draft[b])
        emitted, final = [], None
        for k in range(n_b):
            x = int(draft_ids[b, k])
            p = target_probs[b, k].double().tolist()
            q = _one_hot(x, V) if draft_probs is None else draft_probs[b, k].double().tolist()
            if float(uniforms[b, k]) * q[x] < p[x]:  # u < min(1, p(x) / q(x))
                emitted.append(x)
                continue
            final = ref_sample(_residual(p, q), float(uniforms[b, K]))  # recovered
            break
        if final is None:  # every draft accepted: bonus
            final = ref_sample(target_probs[b, len(emitted)].double().tolist(), float(uniforms[b, K]))
        out_n.append(len(emitted))
        out_emitted.append(emitted + [final])
    return out_n, out_emitted


def ref_verify_chain_match(draft_ids, target_probs, uniforms, num_draft=None):
    """Returns (num_accepted per row, emitted tokens per row)."""
    B, K = draft_ids.shape
    out_n, out_emitted = [], []
    for b in range(B):
        n_b = K if num_draft is None else int(num_draft[b])
        emitted = []
        for k in range(K + 1):
            y = ref_sample(target_probs[b, k].double().tolist(), float(uniforms[b, k]))
            emitted.append(y)
            if k >= n_b or y != int(draft_ids[b, k]):
                break
        out_n.append(len(emitted) - 1)
        out_emitted.append(emitted)
    return out_n, out_emitted


def ref_verify_tree(parents, tokens, target_probs, draft_probs, uniforms, iid):
    """One request. Returns (accepted nodes, emitted tokens)."""
    parents = [int(x) for x in parents]
    V = target_probs.shape[-1]
    children = {r: [i for i, pa in enumerate(parents) if pa + 1 == r] for r in range(len(parents) + 1)}
    row, path = 0, []
    p = target_probs[0].double().tolist()
    while True:
        accepted = None
        for c in children[row]:
            x = int(tokens[c])
            q = draft_probs[c].double().tolist() if iid else _one_hot(x, V)
            if float(uniforms[c + 1]) * q[x] < p[x]:
                accepted = c
                break
            p = _residual(p, q)
        if accepted is None:
            break
        path.append(accepted)
        row = accepted + 1
        p = target_probs[row].double().tolist()
    final = ref_sample(p, float(uniforms[0]))
    return path, [int(tokens[c]) for c in path] + [final]


def greedy_tree_path(parents, tokens, target_probs) -> tuple[list[int], list[int]]:
    """T = 0 expectation: longest root path whose tokens equal the argmax at their parent's row."""
    parents = [int(x) for x in parents]
    argmax = target_probs.argmax(dim=-1).tolist()
    best: list[int] = []
    for end in range(len(parents)):
        path, c = [], end
        while c != -1:
            path.append(c)
            c = parents[c]
        path.reverse()
        if all(int(tokens[c]) == argmax[parents[c] + 1] for c in path) and len(path) > len(best):
            best = path
    last_row = best[-1] + 1 if best else 0
    return best, [int(tokens[c]) for c in best] + [argmax[last_row]]


def rows_as_lists(emitted: torch.Tensor, num_emitted: torch.Tensor) -> list[list[int]]:
    """Emitted tokens per row, without the -1 padding."""
    return [emitted[b, : int(num_emitted[b])].tolist() for b in range(emitted.shape[0])]
