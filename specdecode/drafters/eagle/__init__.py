"""EAGLE-3 (Li et al.): feature-fusing one-layer drafter; chain drafting or EAGLE-2 dynamic trees.

model.py holds the network and its training-time-test loss, drafter.py the inference side.
`load_eagle(path, target, tree)` builds a ready drafter from a checkpoint directory.
"""

from __future__ import annotations

from specdecode.drafter import Method
from specdecode.drafters.checkpoint import load_net
from specdecode.drafters.eagle.drafter import EagleDrafter, TreeSpec
from specdecode.drafters.eagle.model import Eagle3, EagleConfig

__all__ = ["Eagle3", "EagleConfig", "EagleDrafter", "TreeSpec", "load_eagle"]


def load_eagle(path, target, tree: TreeSpec | None = None) -> EagleDrafter:
    net = load_net(path, "eagle", target, lambda arch: Eagle3(EagleConfig.from_json(arch)))
    return EagleDrafter(net, target, tree=tree)


METHOD = Method(
    name="eagle",
    variants={"eagle": 4, "eagle-tree": 16, "eagle-tree-lookup": 16},
    load=lambda variant, target, spec, **kw: load_eagle(
        spec, target, tree=TreeSpec(lookup=variant == "eagle-tree-lookup") if "tree" in variant else None
    ),
    task="eagle",
    train_options={"draft_vocab_size": 8192, "ttt_steps": 3},
    checkpoint="eagle",
    summary="EAGLE-3: one feature-fusing layer; chain, or EAGLE-2 dynamic trees (eagle-tree-lookup: the "
    "continuation of the context's latest n-gram match joins the greedy tree by its score)",
)
