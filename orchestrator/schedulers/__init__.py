"""Schedulers by name (the profile's ``scheduler`` key). See :mod:`orchestrator.schedulers.base`.

Importing this package imports no scheduler implementation: ``status`` over local jobs never pays
for the Slurm module, and neither imports submitit until it submits or runs on a node.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from orchestrator.schedulers.base import Scheduler

#: The profile's ``scheduler`` values (profiles, their schema and the registry take them from here).
SchedulerName = Literal["slurm", "local"]
SCHEDULER_NAMES: tuple[str, ...] = get_args(SchedulerName)
#: name -> "module:class". A new scheduler is its name above, one entry here, and its module.
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
