"""DFlash (z-lab): block-diffusion drafter that fills a whole block in one forward pass.

model.py holds the network and its training loss, drafter.py the inference side (its training
task: training/methods/dflash.py). `load_dflash(path, target)` builds a ready drafter from a
checkpoint directory.
"""

from __future__ import annotations

from specdecode.drafter import Method
from specdecode.drafters.checkpoint import load_net
from specdecode.drafters.dflash.drafter import BlockTree, DFlashDrafter
from specdecode.drafters.dflash.model import DFlash, DFlashConfig, dflash_layers

__all__ = ["BlockTree", "DFlash", "DFlashConfig", "DFlashDrafter", "dflash_layers", "load_dflash"]


def load_dflash(path, target, tree: BlockTree | None = None) -> DFlashDrafter:
    net = load_net(path, "dflash", target, lambda arch: DFlash(DFlashConfig.from_json(arch)))
    return DFlashDrafter(net, target, tree=tree)


METHOD = Method(
    name="dflash",
    variants={"dflash": 7, "dflash-tree": 16, "dflash-tree-lookup": 16},
    load=lambda variant, target, spec, **kw: load_dflash(
        spec, target, tree=BlockTree(lookup=variant == "dflash-tree-lookup") if "tree" in variant else None
    ),
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
    summary="block diffusion: a whole block of drafts in one forward (dflash-tree: a tree of each slot's "
    "top ids; -lookup: prompt lookup's branch joins it)",
)
