"""MTP (DeepSeek-V3): chained multi-token prediction modules as a drafter.

model.py: modules and loss; drafter.py: inference with per-depth caches; training:
training/methods/mtp.py.
"""

from __future__ import annotations

from specdecode.drafter import Method
from specdecode.drafters.checkpoint import load_net
from specdecode.drafters.mtp.drafter import MTPDrafter
from specdecode.drafters.mtp.model import MTP, MTPConfig

__all__ = ["MTP", "MTPConfig", "MTPDrafter", "load_mtp"]


def load_mtp(path, target) -> MTPDrafter:
    net = load_net(path, "mtp", target, lambda arch: MTP(MTPConfig.from_json(arch)))
    return MTPDrafter(net, target)


METHOD = Method(
    name="mtp",
    variants={"mtp": 3},
    load=lambda variant, target, spec, **kw: load_mtp(spec, target),
    task="mtp",
    train_options={"draft_vocab_size": 8192, "num_modules": 3},
    checkpoint="mtp",
    summary="chained multi-token prediction modules (DeepSeek-V3)",
)
