"""Spare nodes (a profile's ``spare_nodes``) and shrinking (``on_node_loss: shrink``): which nodes of
the allocation train, which wait.

The job holds ``nodes + spare_nodes`` nodes (``#SBATCH --nodes``, ``--no-kill`` so that a node
failure does not end the allocation). The training step runs on ``nodes`` of them, named to ``srun``
(``--nodes --ntasks --nodelist``); the rest wait idle, preflighted with the others. A node that is
lost (the batch step's probe), or named by the preflight or the hang watchdog, is left out and the
next step runs with a spare in its place: a restart inside the allocation, with the same job id.
The batch host itself is never left out: nothing of the job survives its death (a requeue).

With no spare left and ``on_node_loss: shrink``, the lost node is left out and the step goes on with
the nodes left (:meth:`Placement.shrink`); the step's environment then says how many nodes it has
and the world size the global batch was chosen for (``train/`` accumulates the difference).

Node order is Slurm's (``SLURM_JOB_NODELIST``, expanded): node 0 of the training, whose address is
the rendezvous, stays the first node still in, normally the batch host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.contract.env import BATCH_WORLD_SIZE_ENV
from orchestrator.schedulers.slurm.environment import STEP_NODES_ENV

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan


@dataclass
class Placement:
    """The allocation's nodes, how many train, and those left out so far."""

    allocation: list[str]
    nodes: int
    left_out: list[str] = field(default_factory=list)
    planned: int = 0
    """The plan's node count (``nodes`` is lower after a shrink)."""
    procs_per_node: int = 1
    may_shrink: bool = False

    def __post_init__(self) -> None:
        self.planned = self.planned or self.nodes

    @property
    def spare_count(self) -> int:
        return len(self.allocation) - self.nodes

    def usable(self, without: tuple[str, ...] = ()) -> list[str]:
        return [n for n in self.allocation if n not in self.left_out and n not in without]

    def training(self) -> list[str]:
        """The nodes the next step trains on."""
        return self.usable()[: self.nodes]

    def spares(self) -> list[str]:
        return self.usable()[self.nodes :]

    def replace(self, bad: list[str]) -> list[str] | None:
        """Leave ``bad`` out when enough nodes stay to train on: the spares that take their places
        (None, and nothing changed, when they do not, or when ``bad`` holds the batch host)."""
        bad = [n for n in bad if n in self.allocation and n not in self.left_out]
        if not bad or (self.allocation and self.allocation[0] in bad):
            return None
        before = self.training()
        if len(self.usable(tuple(bad))) < self.nodes:
            return None
        self.left_out.extend(bad)
        return [n for n in self.training() if n not in before]

    def shrink(self, lost: list[str]) -> int | None:
        """Leave ``lost`` out and train on the nodes left: their count (None, nothing changed, when
        none would be left or ``lost`` holds the batch host)."""
        lost = [n for n in lost if n in self.allocation and n not in self.left_out]
        if not lost or (self.allocation and self.allocation[0] in lost):
            return None
        left = len(self.usable(tuple(lost)))
        if left < 1:
            return None
        self.left_out.extend(lost)
        self.nodes = min(self.nodes, left)
        return self.nodes

    def step_env(self) -> dict[str, str]:
        """What a shrunk step's node entry and ranks are told (nothing before a shrink)."""
        if self.nodes >= self.planned:
            return {}
        return {
            STEP_NODES_ENV: str(self.nodes),
            BATCH_WORLD_SIZE_ENV: str(self.planned * self.procs_per_node),
        }

    def step_argv(self, argv: list[str]) -> list[str]:
        """``srun ...`` told which nodes train: the options go right after ``srun``."""
        if not argv or argv[0] != "srun":
            return argv
        chosen = self.training()
        # After a node was lost, the failed step stays "completing" on the healthy nodes until Slurm
        # declares the dead one DOWN (SlurmdTimeout: 300 s by default), and a new step there waits
        # ("Requested nodes are busy"); its processes are gone, so the new step may overlap it.
        overlap = ["--overlap"] if self.left_out else []
        return [
            "srun",
            f"--nodes={len(chosen)}",
            f"--ntasks={len(chosen)}",
            f"--nodelist={','.join(chosen)}",
            *overlap,
            *argv[1:],
        ]


def placement_of(
    allocation: list[str], nodes: int, spare_nodes: int, shrink: bool = False, procs_per_node: int = 1
) -> Placement | None:
    """The placement of a job with spares or that may shrink (None otherwise: the step runs on the
    whole allocation)."""
    if not shrink and (spare_nodes <= 0 or len(allocation) <= nodes):
        return None
    return Placement(list(allocation), nodes, procs_per_node=procs_per_node, may_shrink=shrink)


def shrink_refusal(plan: LaunchPlan, nodes: int) -> str | None:
    """Why the run cannot go on at ``nodes`` nodes keeping its global batch (None: it can)."""
    from orchestrator.config.plan import check_combination
    from orchestrator.contract.errors import UserError

    if plan.strategy.uses_deepspeed:
        return f"strategy {plan.options.strategy} does not reshard its checkpoint to fewer ranks here"
    world, new_world = plan.world_size, nodes * plan.procs_per_node
    if world % new_world:
        return f"world size {new_world} does not divide {world}: the global batch could not be kept"
    try:
        check_combination(plan.profile_name, plan.profile, plan.options, nodes, plan.procs_per_node)
    except UserError as exc:
        return f"{nodes} node(s) is no valid job for this plan: {exc}"
    return None
