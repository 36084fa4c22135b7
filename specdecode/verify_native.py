"""The verify step's chains and argmaxes on our CPU kernel (`models/kernels/verify.cpp`).

Contract:
- `native_chain(logits, draft_ids, num_draft, q, uniforms, params, vocab_size, q_ids=None,
  block=False)` returns (num_accepted [B], final_ids [B]) long on the CPU: the verdict
  `verify.verify_chain` (q given), `verify.verify_chain_block` (q given, block) or
  `verify.verify_chain_match` (q None) would give, with every request greedy or sampling at a
  plain temperature, or None where the kernel does not apply (kernels absent or switched off,
  tensors not on the CPU, top-k / top-p in some request); the caller then takes the tensor path.
  The uniforms are laid out as `verify.step_uniforms` lays them out for that mode. q spans the
  target's ids, or with q_ids [Vd] (`Proposal.draft_vocab`) a draft vocabulary: column j is
  target id q_ids[j], every other id has q = 0.
- `native_rows(params, vocab_size, logits, q)` -> the rows (requests) the kernel verifies: those
  greedy or at a plain temperature, none where the kernel does not apply. `verify.verify_step`
  sends a mixed batch's two parts down their two paths, so a request's verdict never depends on
  its neighbours' settings.
- `native_tree(logits, tree_ids, parents, uniforms, params, vocab_size)` returns (path [B, N],
  final_ids [B]) long: the verdict `verify_rules.verify_tree_batch` gives a tree of point-mass
  candidates (iid False; path = its accepted nodes, -1 after them), every request sampling at a
  plain temperature (> 0), or None where the kernel does not apply. Uniforms in the tree layout.
  `native_tree_rows(params, vocab_size, logits)`: the requests it covers.
- `argmax_ids(logits [..., V'], vocab_size)` -> [...] long: the first largest logit among the
  first vocab_size ids (torch.argmax's choice), on the kernel where it applies.
What changes against the tensor path: the target's probabilities are softmax up to rounding (the
kernel's exponential, sums in fixed chunks), so a sampled request may draw another id where a
uniform falls within rounding of a boundary; greedy verdicts are identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.config import SamplingParams
from specdecode.models import kernels
from specdecode.sampling import plain_temperature


def _ops(*tensors: torch.Tensor):
    ops = kernels.fused()
    if ops is None or not all(t.device.type == "cpu" for t in tensors):
        return None
    return ops


def _covered(p: SamplingParams, vocab_size: int) -> bool:
    return p.greedy or plain_temperature(p, vocab_size)


def native_rows(
    params: Sequence[SamplingParams], vocab_size: int, logits: torch.Tensor, q: torch.Tensor | None
) -> list[int]:
    if _ops(logits, *(() if q is None else (q,))) is None:
        return []
    return [b for b, p in enumerate(params) if _covered(p, vocab_size)]


def native_tree_rows(params: Sequence[SamplingParams], vocab_size: int, logits: torch.Tensor) -> list[int]:
    if _ops(logits) is None:
        return []
    return [b for b, p in enumerate(params) if not p.greedy and plain_temperature(p, vocab_size)]


def argmax_ids(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:  # [..., V'] -> [...]
    V = logits.shape[-1] if vocab_size is None else vocab_size
    ops = _ops(logits) if logits.dtype == torch.float32 and logits.numel() else None
    if ops is None:
        return logits[..., :V].argmax(dim=-1)
    flat = logits.reshape(-1, logits.shape[-1])  # a view of the model's contiguous logits
    return ops.row_argmax(flat, V).view(logits.shape[:-1])


def native_chain(
    logits: torch.Tensor,  # [B, K+1, V'] the target's logits at the verify block
    draft_ids: torch.Tensor,  # [B, K] long
    num_draft: torch.Tensor,  # [B] long
    q: torch.Tensor | None,  # [B, K, >= vocab_size | Vd] the drafts' distributions; None = point masses
    uniforms: torch.Tensor,  # [B, K+1]
    params: Sequence[SamplingParams],
    vocab_size: int,
    q_ids: torch.Tensor | None = None,  # [Vd] long: q's columns' target ids (None: q spans V)
    block: bool = False,  # with q: block verification (verify_rules.verify_chain_block)
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not all(_covered(p, vocab_size) for p in params):
        return None
    ops = _ops(logits, *(() if q is None else (q,)))
    if ops is None:
        return None
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)  # 0 = greedy
    return ops.verify_chain(
        logits.float(),
        draft_ids.cpu().long(),
        num_draft.cpu().long(),
        None if q is None else q.float(),
        uniforms.float(),
        temps,
        vocab_size,
        None if q is None or q_ids is None else q_ids.cpu().long(),
        block and q is not None,
    )


def native_tree(
    logits: torch.Tensor,  # [B, N+1, V'] the target's logits at the verify block (row 0 = root)
    tree_ids: torch.Tensor,  # [B, N] long: node tokens, -1 = no node
    parents: torch.Tensor,  # [B, N] long: -1 = the root
    uniforms: torch.Tensor,  # [B, N+1] (tree layout)
    params: Sequence[SamplingParams],
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if len(native_tree_rows(params, vocab_size, logits)) < len(params) or not params:
        return None
    ops = _ops(logits)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    return ops.verify_tree(
        logits.float(), tree_ids.cpu().long(), parents.cpu().long(), uniforms.float(), temps, vocab_size
    )
