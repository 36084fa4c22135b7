"""DSpark (DeepSeek-AI + PKU): DFlash-style parallel backbone + Markov head + calibrated
confidence head.

model.py: network and loss; drafter.py: sequential sampling and confidence truncation;
training: training/methods/dspark.py; calibration (`specdecode calibrate`): training/calibrate.py.
`load_dspark(path, target, ...)` builds a ready drafter from a checkpoint directory.
"""

from __future__ import annotations

import torch

from specdecode.drafter import Method
from specdecode.drafters.checkpoint import load_net
from specdecode.drafters.dflash.drafter import BlockTree
from specdecode.drafters.dflash.model import DFlashConfig
from specdecode.drafters.dspark.drafter import DSparkDrafter
from specdecode.drafters.dspark.model import DSpark

__all__ = ["DSpark", "DSparkDrafter", "load_dspark"]


def load_dspark(
    path, target, confidence_threshold=None, threshold_on: str = "survival", tree: BlockTree | None = None
) -> DSparkDrafter:
    # Checkpoints from before the opt-in bias have no `sts_bias`: zeros are what they meant.
    net = load_net(
        path,
        "dspark",
        target,
        lambda arch: DSpark(DFlashConfig.from_json(arch)),
        defaults=lambda net: {"sts_bias": torch.zeros(net.cfg.block_size)},
    )
    return DSparkDrafter(net, target, confidence_threshold, threshold_on, tree=tree)


def _load(variant, target, spec, confidence_threshold=None, threshold_on="survival", **kw) -> DSparkDrafter:
    tree = BlockTree(lookup=variant == "dspark-tree-lookup") if "tree" in variant else None
    return load_dspark(spec, target, confidence_threshold, threshold_on, tree=tree)


METHOD = Method(
    name="dspark",
    variants={"dspark": 7, "dspark-tree": 16, "dspark-tree-lookup": 16},
    load=_load,
    task="dspark",
    train_options={
        "draft_vocab_size": 8192,
        "num_layers": 2,
        "block_size": 7,
        "num_anchors": 32,
        "markov_rank": 256,
        "qk_norm": True,
        "train_only": None,
        "mask_token_id": "auto",
    },
    options=("confidence_threshold", "threshold_on"),
    checkpoint="dspark",
    summary="DFlash backbone + Markov head + calibrated confidences for the scheduler (dspark-tree: a tree "
    "of the Markov head's top children; -lookup: prompt lookup's branch joins it)",
)
