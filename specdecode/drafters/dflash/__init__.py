"""DFlash (z-lab): block-diffusion drafter that fills a whole block in one forward pass.

model.py holds the network and its training loss, drafter.py the inference side, train.py the
trainer task. `load_dflash(path, target)` builds a ready drafter from a checkpoint directory.
"""

from __future__ import annotations

from specdecode.drafters.checkpoint import load_checkpoint
from specdecode.drafters.dflash.drafter import DFlashDrafter
from specdecode.drafters.dflash.model import DFlash, DFlashConfig, dflash_layers

__all__ = ["DFlash", "DFlashConfig", "DFlashDrafter", "dflash_layers", "load_dflash"]


def load_dflash(path, target) -> DFlashDrafter:
    from specdecode.drafters.eagle import drafter_dtype

    arch, state = load_checkpoint(path, "dflash", target)
    net = DFlash(DFlashConfig.from_json(arch))
    net.load_state_dict(state)
    net.to(device=target.model.info.device, dtype=drafter_dtype(target))
    drafter = DFlashDrafter(net, target)
    drafter.fingerprint = f"dflash:{path}"
    return drafter
