"""Medusa (Cai et al. 2024): K heads on the target's last state; chain or static tree drafting.

model.py: heads and loss; drafter.py: inference; its training task is training/methods/medusa.py.
"""

from __future__ import annotations

from specdecode.drafter import Method
from specdecode.drafters.checkpoint import load_net
from specdecode.drafters.medusa.drafter import MedusaDrafter, default_paths
from specdecode.drafters.medusa.model import Medusa, MedusaConfig
from specdecode.tree import tree_from_paths

__all__ = ["Medusa", "MedusaConfig", "MedusaDrafter", "default_paths", "load_medusa"]


def load_medusa(path, target, tree: bool = False, num_nodes: int = 16) -> MedusaDrafter:
    net = load_net(path, "medusa", target, lambda arch: Medusa(MedusaConfig.from_json(arch)))
    shape = tree_from_paths(default_paths(num_nodes, net.cfg.num_heads)) if tree else None
    return MedusaDrafter(net, target, tree=shape)


METHOD = Method(
    name="medusa",
    variants={"medusa": 4, "medusa-tree": 16},
    load=lambda variant, target, spec, **kw: load_medusa(spec, target, tree=variant == "medusa-tree"),
    task="medusa",
    train_options={"draft_vocab_size": 8192, "num_heads": 4},
    checkpoint="medusa",
    summary="K heads on the target's last state; chain or static tree",
)
