"""Scheduler names and what planning needs to know of each, without loading its implementation.

The profile's ``scheduler`` key, its schema, the registry, the plan's checks and rendering read this
leaf; :mod:`orchestrator.schedulers` maps each name to its implementation, whose class takes these
facts from here (:meth:`orchestrator.schedulers.base.Scheduler.__init_subclass__`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

#: The profile's ``scheduler`` values. A new scheduler is its name here, its kind below, and its package.
SchedulerName = Literal["slurm", "local"]
SCHEDULER_NAMES: tuple[str, ...] = get_args(SchedulerName)


@dataclass(frozen=True)
class SchedulerKind:
    """The facts of a scheduler that a plan, a profile check or ``render`` depends on."""

    name: str
    can_lose_nodes: bool
    """Whether a node can die under a job (and ``--auto-resume`` can exclude it); where none can,
    there is no other node to choose either, so ``--exclude`` is refused too."""
    has_dependencies: bool
    """Whether a job can wait for another (``--after``): refused at planning where it cannot, so
    ``render``, ``submit``, ``sweep`` and the API all say so (``render`` accepted it silently)."""
    needs_partition: bool
    """Whether a profile must name a partition (a profile check, before anything is rendered)."""
    writes_batch_script: bool
    """Whether the request's text is a batch script worth showing in ``render``."""
    has_arrays: bool
    """Whether a sweep's tasks can be one job array."""
    render_main_ip: str
    """The main process address ``render`` shows (a sample where the real one is known only on the node)."""
    gpus_of_this_machine: bool
    """Whether its nodes are this machine: a GPU profile then trains on the GPUs found here (counted at
    planning, :mod:`orchestrator.config.gpus`), one rank per GPU, never more than there are."""
    ends_for_good: bool
    """Whether a job that has ended can never run again under its id (local: a new attempt is a new
    job). Where it can (Slurm: an administrator's requeue, a requeue after NODE_FAIL), an ended state may
    still move on while the scheduler reports it."""
    has_queue: bool
    """Whether a job may wait before it starts, so that asking when it would start means something
    (``submit --test-only``, the estimate ``submit`` and ``status`` print)."""
    rdzv_backend: str | None
    """torchrun's rendezvous backend; None: the profile's ``rdzv_backend``. Local simulated nodes share
    one host, where c10d's rendezvous races for the port: static."""


SCHEDULER_KINDS: dict[str, SchedulerKind] = {
    "slurm": SchedulerKind(
        name="slurm",
        can_lose_nodes=True,
        has_dependencies=True,
        needs_partition=True,
        writes_batch_script=True,
        has_arrays=True,
        render_main_ip="10.0.0.1",
        gpus_of_this_machine=False,
        ends_for_good=False,
        has_queue=True,
        rdzv_backend=None,
    ),
    "local": SchedulerKind(
        name="local",
        can_lose_nodes=False,
        has_dependencies=False,
        needs_partition=False,
        writes_batch_script=False,
        has_arrays=False,
        render_main_ip="127.0.0.1",
        gpus_of_this_machine=True,
        ends_for_good=True,
        has_queue=False,
        rdzv_backend="static",
    ),
}


def scheduler_kind(name: str) -> SchedulerKind:
    """The kind of a scheduler a profile names (profiles are validated: the name is always known)."""
    return SCHEDULER_KINDS[name]
