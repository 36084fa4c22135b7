"""MTP (DeepSeek-V3): chained multi-token prediction modules as a drafter.

model.py: modules and loss; drafter.py: inference with per-depth caches; train.py: trainer task.
"""

from __future__ import annotations

from specdecode.drafters.checkpoint import load_checkpoint
from specdecode.drafters.mtp.drafter import MTPDrafter
from specdecode.drafters.mtp.model import MTP, MTPConfig

__all__ = ["MTP", "MTPConfig", "MTPDrafter", "load_mtp"]


def load_mtp(path, target) -> MTPDrafter:
    from specdecode.drafters.eagle import drafter_dtype

    arch, state = load_checkpoint(path, "mtp", target)
    net = MTP(MTPConfig.from_json(arch))
    net.load_state_dict(state)
    net.to(device=target.model.info.device, dtype=drafter_dtype(target))
    drafter = MTPDrafter(net, target)
    drafter.fingerprint = f"mtp:{path}"
    return drafter
