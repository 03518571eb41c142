"""Spare nodes (a profile's ``spare_nodes``): which nodes of the allocation train, which wait.

The job holds ``nodes + spare_nodes`` nodes (``#SBATCH --nodes``, ``--no-kill`` so that a node
failure does not end the allocation). The training step runs on ``nodes`` of them, named to ``srun``
(``--nodes --ntasks --nodelist``); the rest wait idle, preflighted with the others. A node that is
lost (the batch step's probe), or named by the preflight or the hang watchdog, is left out and the
next step runs with a spare in its place: a restart inside the allocation, with the same job id.
The batch host itself is never left out: nothing of the job survives its death (a requeue).

Node order is Slurm's (``SLURM_JOB_NODELIST``, expanded): node 0 of the training, whose address is
the rendezvous, stays the first node still in, normally the batch host.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Placement:
    """The allocation's nodes, how many train, and those left out so far."""

    allocation: list[str]
    nodes: int
    left_out: list[str] = field(default_factory=list)

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


def placement_of(allocation: list[str], nodes: int, spare_nodes: int) -> Placement | None:
    """The placement of a job with spares (None without: the step runs on the whole allocation)."""
    if spare_nodes <= 0 or len(allocation) <= nodes:
        return None
    return Placement(list(allocation), nodes)
