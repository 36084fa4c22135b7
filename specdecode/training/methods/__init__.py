"""Training tasks, one module per method family (named by `Method.task` in the drafter registry).

Contract: `TASKS[task]` is the task class the shared trainer (training/trainer.py) runs for that
family: it builds the drafter network from the target and the data, its loss module, the
checkpoint's architecture and state, and a ready drafter for the served-tau evaluation.
"""

from __future__ import annotations

from specdecode.training.methods.dflash import DFlashTask
from specdecode.training.methods.draft import DistillTask
from specdecode.training.methods.dspark import DSparkTask
from specdecode.training.methods.eagle import EagleTask
from specdecode.training.methods.medusa import MedusaTask
from specdecode.training.methods.mtp import MTPNativeTask, MTPTask

TASKS = {
    "eagle": EagleTask,
    "medusa": MedusaTask,
    "mtp": MTPTask,
    "draft": DistillTask,
    "dflash": DFlashTask,
    "dspark": DSparkTask,
}

__all__ = [
    "TASKS",
    "DFlashTask",
    "DSparkTask",
    "DistillTask",
    "EagleTask",
    "MTPNativeTask",
    "MTPTask",
    "MedusaTask",
]
