"""EAGLE-3 (Li et al.): feature-fusing one-layer drafter; chain drafting or EAGLE-2 dynamic trees.

model.py holds the network and its training-time-test loss, drafter.py the inference side.
`load_eagle(path, target, tree)` builds a ready drafter from a checkpoint directory.
"""

from __future__ import annotations

import torch

from specdecode.drafters.checkpoint import load_checkpoint
from specdecode.drafters.eagle.drafter import EagleDrafter, TreeSpec
from specdecode.drafters.eagle.model import Eagle3, EagleConfig, ttt_loss

__all__ = ["Eagle3", "EagleConfig", "EagleDrafter", "TreeSpec", "load_eagle", "ttt_loss"]


def drafter_dtype(target) -> torch.dtype:
    """The target's dtype, except fp32 on CPUs without native bf16 products (a small net gains
    nothing from bf16 there and its matmuls run on a slow generic kernel)."""
    from specdecode.models.native import cpu_has_fast_bf16

    info = target.model.info
    if info.device.type == "cpu" and info.dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        return torch.float32
    return info.dtype


def load_eagle(path, target, tree: TreeSpec | None = None) -> EagleDrafter:
    arch, state = load_checkpoint(path, "eagle", target)
    net = Eagle3(EagleConfig.from_json(arch))
    net.load_state_dict(state)
    net.to(device=target.model.info.device, dtype=drafter_dtype(target))
    drafter = EagleDrafter(net, target, tree=tree)
    drafter.fingerprint = f"eagle:{path}"
    return drafter
