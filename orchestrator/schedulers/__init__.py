"""Schedulers by name (the profile's ``scheduler`` key). See :mod:`orchestrator.schedulers.base`.

Importing this package imports no scheduler implementation: ``status`` over local jobs never pays
for the Slurm module, and neither imports submitit until it submits or runs on a node.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.schedulers.base import Scheduler

#: name (:data:`~orchestrator.config.scheduler_kinds.SCHEDULER_NAMES`) -> "module:class".
IMPLEMENTATIONS: dict[str, str] = {
    "slurm": "orchestrator.schedulers.slurm.scheduler:SlurmScheduler",
    "local": "orchestrator.schedulers.local.scheduler:LocalScheduler",
}


@cache
def get_scheduler(name: str) -> Scheduler:
    """The scheduler a profile names (profiles are validated: the name is always known here)."""
    module, _, cls = IMPLEMENTATIONS[name].partition(":")
    scheduler: Scheduler = getattr(importlib.import_module(module), cls)()
    return scheduler
