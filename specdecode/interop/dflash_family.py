"""DFlash / DSpark in foreign layouts: why they do not convert to or from specdecode's network.

Contract:
- The published DFlash layer (z-lab `DFlashDraftModel`, speculators `DFlashDraftModel` /
  `DSparkDraftModel`, vLLM and SGLang's DFlash) is a Qwen3 layer: its attention applies a
  per-head RMSNorm to the queries and to the keys (`q_norm`, `k_norm`) before RoPE, on context
  and block rows alike. specdecode's DFlash layer (drafters/dflash/model.py) has no such norm,
  and no weights make an RMSNorm the identity, so neither direction can be exact. Their mask
  slots read the target's embedding of `mask_token_id`; ours read a learned vector `mask_emb`.
- `export_refusal(method, arch, state)` -> the reasons (a list of sentences) an export of one
  of our DFlash / DSpark checkpoints is refused; never empty today.
- `import_refusal(where, cfg_layer, state, layer_ids, target)` checks the foreign drafter
  against the target first (a drafter for another target is refused as such) and then raises
  with the architecture reasons. Both raise `SpecDecodeError` through `refuse`.
"""

from __future__ import annotations

import torch

from specdecode.errors import SpecDecodeError
from specdecode.interop.common import check_target

QK_NORM = (
    "the format's DFlash layer normalises queries and keys per head (Qwen3 q_norm / k_norm "
    "RMSNorm before RoPE) and specdecode's DFlash layer does not; no weights turn an RMSNorm "
    "into the identity"
)
MASK_VECTOR = (
    "its mask slots read the target's embedding of one `mask_token_id`, while specdecode's read a "
    "learned vector (`mask_emb`) that is not a row of the target's embedding"
)
HINT = (
    "Serve this drafter with specdecode, or train the DFlash family with per-head q/k norms and "
    "a mask token id (docs/interop.md, 'DFlash and DSpark')"
)


def export_refusal(method: str, arch: dict, state: dict[str, torch.Tensor]) -> list[str]:
    reasons = [QK_NORM, MASK_VECTOR]
    if method == "dspark":
        bias = state.get("sts_bias")
        if bias is not None and bool((bias.float() != 0).any()):
            reasons.append(
                "its confidence head carries a per-position calibration bias (`calibrate --bias`) "
                "that the format's confidence head cannot hold"
            )
    return reasons


def refuse(where: str, reasons: list[str]) -> None:
    raise SpecDecodeError(f"{where} cannot be converted exactly: " + "; ".join(reasons) + f". {HINT}")


def import_refusal(
    where: str,
    layer: dict,  # the foreign layer config (Qwen3 fields)
    state: dict[str, torch.Tensor],
    layer_ids: list[int],  # ours: 0-based target layers whose output is a feature
    target,  # LoadedModel
) -> None:
    check_target(where, target, int(layer["hidden_size"]), int(layer["vocab_size"]), layer_ids)
    reasons = []
    qk = any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in state)
    if qk or layer.get("model_type") == "qwen3":
        reasons.append(QK_NORM)
    if not reasons:  # a layout we have not seen: still not one our builders read
        reasons.append("its layer is not one specdecode's DFlash builder reads")
    refuse(where, reasons)
