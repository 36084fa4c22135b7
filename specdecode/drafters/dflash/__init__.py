"""DFlash (z-lab): block-diffusion drafter that fills a whole block in one forward pass.

model.py holds the network and its training loss, drafter.py the inference side (its training
task: training/methods/dflash.py). `load_dflash(path, target)` builds a ready drafter from a
checkpoint directory.
"""

from __future__ import annotations

from specdecode.drafter import Method
from specdecode.drafters.checkpoint import load_net
from specdecode.drafters.dflash.drafter import DFlashDrafter
from specdecode.drafters.dflash.model import DFlash, DFlashConfig, dflash_layers

__all__ = ["DFlash", "DFlashConfig", "DFlashDrafter", "dflash_layers", "load_dflash"]


def load_dflash(path, target) -> DFlashDrafter:
    net = load_net(path, "dflash", target, lambda arch: DFlash(DFlashConfig.from_json(arch)))
    return DFlashDrafter(net, target)


METHOD = Method(
    name="dflash",
    variants={"dflash": 7},
    load=lambda variant, target, spec, **kw: load_dflash(spec, target),
    task="dflash",
    train_options={
        "draft_vocab_size": 8192,
        "num_layers": 2,
        "block_size": 8,
        "num_anchors": 32,
        "qk_norm": True,  # with mask_token_id: the published layer vLLM / speculators serve
        "mask_token_id": "auto",  # the tokenizer's mask / unk / pad / eos token (default_mask_token)
    },
    checkpoint="dflash",
    summary="block diffusion: a whole block of drafts in one forward",
)
