"""The draft vocabulary: the target ids a reduced-vocabulary drafter head predicts.

Contract: `draft_vocabulary(seqs, size, eos_ids, vocab_rows)` -> (d2t, coverage): the `size` most
frequent response tokens of the training sequences as sorted target ids (EOS always included;
filled with the lowest unused ids when the data has fewer distinct tokens), and the share of
response tokens they cover; `vocabulary_of(counts, ...)` the same from counts already made.
Every method with a reduced head (EAGLE-3, Medusa, MTP, DFlash, DSpark, the distilled draft
model) picks its vocabulary here. `coverage(seqs, d2t)`: the share of response tokens a given
draft vocabulary covers. `pick_vocabulary(..., d2t)`: what every training task calls:
`draft_vocabulary`, or a given one (a warm start's, which its head was trained on) with its
coverage.
"""

from __future__ import annotations

from collections import Counter

import torch

from specdecode.errors import SpecDecodeError


def _response_counts(seqs) -> Counter:
    counts = Counter()
    for s in seqs:
        counts.update(s.input_ids[s.loss_mask.bool()].tolist())
    return counts


def coverage(seqs, d2t: torch.Tensor) -> float:
    """Share of the response tokens of `seqs` whose id is in the draft vocabulary `d2t`."""
    counts = _response_counts(seqs)
    return sum(counts[t] for t in set(d2t.tolist())) / max(sum(counts.values()), 1)


def draft_vocabulary(seqs, size: int, eos_ids, vocab_rows: int) -> tuple[torch.Tensor, float]:
    """Most frequent response tokens (sorted ids) and the share of response tokens they cover."""
    return vocabulary_of(_response_counts(seqs), size, eos_ids, vocab_rows)


def vocabulary_of(counts: Counter, size: int, eos_ids, vocab_rows: int) -> tuple[torch.Tensor, float]:
    """`draft_vocabulary` from response-token counts already made (token id -> count)."""
    chosen = [t for t, _ in counts.most_common(size)]
    for e in eos_ids:
        if e not in chosen:
            chosen = chosen[: size - 1] + [e]
    if len(chosen) < size:  # fill with the lowest unused ids so the head has `size` rows
        used = set(chosen)
        chosen += [t for t in range(vocab_rows) if t not in used][: size - len(chosen)]
    total = sum(counts.values())
    cover = sum(counts[t] for t in chosen) / max(total, 1)
    return torch.tensor(sorted(chosen)), cover


def pick_vocabulary(seqs, size: int, eos_ids, vocab_rows: int, d2t=None) -> tuple[torch.Tensor, float]:
    """`d2t` (sorted target ids, e.g. from the checkpoint a run starts from) and its coverage, or
    `draft_vocabulary(...)` when none is given."""
    if d2t is None:
        return draft_vocabulary(seqs, size, eos_ids, vocab_rows)
    d2t = torch.as_tensor(d2t).long().cpu()
    if len(d2t) != size:
        raise SpecDecodeError(
            f"the starting checkpoint's draft vocabulary holds {len(d2t)} ids, not draft_vocab_size "
            f"= {size}; "
            "train with the options it was made with (--draft-vocab), or drop --init-from"
        )
    return d2t, coverage(seqs, d2t)
