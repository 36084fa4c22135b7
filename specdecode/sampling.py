"""Logits -> processed probabilities, and seeded inverse-CDF sampling.

Contract (pure functions, no state):
* `process_logits(logits [..., V], params, vocab_size)` returns fp32 probabilities of the same
  shape: ids >= vocab_size (padded LM-head rows) get probability 0; then temperature, top-k,
  top-p, renormalise. Temperature 0 returns a one-hot on the argmax, so greedy decoding runs
  through the same verification code as sampling. The drafter's q and the target's p must both
  come from here with the same params, or verification is not lossless for the request.
* `sample(probs [..., V], uniforms [...])` maps caller-supplied uniforms in [0, 1) to ids by
  inverse CDF. It never returns an id of probability 0 and never an id outside [0, V), even when
  rounding makes the cumulative sum end below 1 (probs need not be normalised). Whatever its
  input (NaN, all zeros), the id stays inside [0, V).
* `finite_rows(logits [B, N, V]) -> [B] bool`: False for a row with a NaN or +inf logit, or a
  position whose logits are all -inf; processing such a row would give NaN probabilities, so
  the loop ends that request with an error instead (its neighbours are unaffected).
* `draw_uniforms(generators, n)` gives each request its own row of uniforms from its own
  `torch.Generator`, so a request's randomness never depends on the batch it is in.
* `plain_temperature(params, vocab_size)`: sampling at T > 0 with neither top-k nor top-p over
  that vocabulary (processing is then one softmax: what the compiled samplers implement).
* `seeded_generator(seed, stream)` is a CPU `torch.Generator` whose whole Mersenne-Twister state
  comes from all 64 bits of `seed` (and the stream number) through numpy's SeedSequence:
  `torch.Generator.manual_seed` alone keeps only the low 32 bits, so seeds 1 and 1 + 2**32
  would sample alike.

Top-k keeps exactly k ids (ties broken by `torch.topk`); top-p keeps the smallest prefix of the
probability-sorted ids whose mass reaches top_p (always at least the most likely id).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.config import SamplingParams

__all__ = [
    "process_logits",
    "process_logits_batch",
    "plain_temperature",
    "sample",
    "draw_uniforms",
    "finite_rows",
    "seeded_generator",
]

_TOP_P_CANDIDATES = 256  # first candidate-set size for top-p without top-k
_MT_WORDS = 624  # Mersenne-Twister state words
_MASK64 = 2**64 - 1
log = logging.getLogger("specdecode.sampling")


def process_logits(
    logits: torch.Tensor,  # [..., V] any float dtype
    params: SamplingParams,
    vocab_size: int | None = None,
) -> torch.Tensor:  # [..., V] fp32, rows sum to 1
    """Processed probabilities: vocab mask -> temperature -> top-k -> top-p -> renormalise."""
    x = logits.float()
    V = x.shape[-1]
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if vocab_size < V:
            # Padded head rows can hold large logits; they must never be emitted.
            padded = torch.arange(V, device=x.device) >= vocab_size
            x = x.masked_fill(padded, float("-inf"))
    if params.temperature == 0.0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    # Shift by the row maximum first (softmax does not change): x / T then never overflows to
    # +inf, however small T (>= MIN_TEMPERATURE) or large the logits.
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature
    k = params.top_k if 0 < params.top_k < V else V
    if k == V and params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)

    # Candidates sorted by probability, descending, with their probabilities after top-k.
    if k < V:
        vals, idx = torch.topk(x, k, dim=-1, sorted=True)  # [..., k]
        probs = torch.softmax(vals, dim=-1)
    else:
        # Top-p alone: the kept prefix is usually short, so look at the m best ids first and
        # widen only for batches whose m best fall short of top_p (a full sort of a 150k
        # vocabulary costs ~20 ms a row on CPU). The kept set is the same as with a full sort.
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        m = min(V, _TOP_P_CANDIDATES)
        while True:
            vals, idx = torch.topk(x, m, dim=-1, sorted=True)  # [..., m]
            probs = torch.exp(vals - lse)
            if m == V or bool((probs.cumsum(dim=-1)[..., -1] >= params.top_p).all()):
                break
            m = min(V, 8 * m)
    if params.top_p < 1.0:
        # Keep id j iff the mass strictly before it is < top_p: the smallest prefix reaching
        # top_p, and always the first id (explicitly: a top_p that rounds to 0 keeps it too).
        before = F.pad(probs.cumsum(dim=-1)[..., :-1], (1, 0))
        keep = before < params.top_p
        keep[..., 0] = True
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(x).scatter_(-1, idx, probs)


def process_logits_batch(
    logits: torch.Tensor,  # [B, N, V]
    params: list[SamplingParams],  # one per request (row of logits)
    vocab_size: int | None = None,
) -> torch.Tensor:  # [B, N, V] fp32
    """`process_logits` with per-request params; rows with identical params share one call."""
    if logits.dim() != 3 or len(params) != logits.shape[0]:
        raise ValueError(
            f"expected logits [B, N, V] and one SamplingParams per row, got shape "
            f"{tuple(logits.shape)} and {len(params)} params"
        )
    groups: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p, []).append(row)
    if len(groups) <= 1:
        if not groups:
            return logits.float()
        return process_logits(logits, params[0], vocab_size)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for p, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out.index_copy_(0, idx, process_logits(logits.index_select(0, idx), p, vocab_size))
    return out


def plain_temperature(params: SamplingParams, vocab_size: int) -> bool:
    """T > 0, and top-k / top-p keep every id of a `vocab_size` vocabulary."""
    return params.temperature > 0 and not 0 < params.top_k < vocab_size and params.top_p >= 1.0


def sample(
    probs: torch.Tensor,  # [..., V] non-negative, positive total; need not be normalised
    uniforms: torch.Tensor,  # [...] in [0, 1)
) -> torch.Tensor:  # [...] long
    """Inverse-CDF sampling: the id whose cumulative-mass interval contains u * total."""
    cdf = probs.cumsum(dim=-1)  # [..., V], non-decreasing
    total = cdf[..., -1:]
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * total
    # Keep the target strictly below the total so the search never runs past the last
    # positive-probability id (u * total can round up to total).
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    # right=True: the first id with cdf > target, which has cdf strictly increasing there,
    # hence positive probability. The clamp only matters for invalid input (NaN, all zeros),
    # which `finite_rows` keeps out of the loop: even then the id stays inside the vocabulary.
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp_(0, probs.shape[-1] - 1)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:  # [B, N, V] -> [B] bool
    """Rows whose every position has a finite maximum (no NaN, no +inf, not all -inf)."""
    # amax propagates NaN, is +inf if any logit is, and -inf only if all are: one pass.
    return torch.isfinite(logits.amax(dim=-1)).all(dim=-1)


def draw_uniforms(
    generators: list[torch.Generator],  # one per request
    n: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [B, n] fp32 in [0, 1)
    """One row of n uniforms per request, each drawn from that request's own generator."""
    if not generators:
        return torch.empty(0, n, device=device)
    dev = torch.device(device) if device is not None else generators[0].device
    return torch.stack([torch.rand(n, generator=g, device=g.device).to(dev) for g in generators])


@functools.cache
def _mt_state_offset() -> int | None:
    """Byte offset of the 624 MT19937 words (stored as uint64) in a CPU generator's state, found
    by looking for a known seed's words (numpy's legacy seeding is the same algorithm)."""
    state = torch.Generator().manual_seed(12345).get_state().numpy().tobytes()
    words = np.random.RandomState(12345).get_state()[1][:2].astype(np.uint64).tobytes()
    at = state.find(words)
    if at < 0 or at + 8 * _MT_WORDS > len(state):
        log.warning("unknown torch generator state layout: seeds fall back to 32 bits")
        return None
    return at


def seeded_generator(seed: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded by all 64 bits of `seed` (two streams of one seed are independent)."""
    seq = np.random.SeedSequence(entropy=seed & _MASK64, spawn_key=(stream,))
    gen = torch.Generator()
    at = _mt_state_offset()
    if at is None:
        return gen.manual_seed(int(seq.generate_state(1, np.uint32)[0]))
    state = gen.manual_seed(0).get_state().clone()  # the next draw re-twists from the state words
    words = seq.generate_state(_MT_WORDS, np.uint32).astype(np.uint64)
    state[at : at + 8 * _MT_WORDS] = torch.from_numpy(words.view(np.uint8).copy())
    gen.set_state(state)
    return gen
