"""``orchestrator doctor``'s step on Slurm: one blocking ``srun`` that allocates the profile's nodes,
runs one task per node and ends with it (:meth:`Scheduler.doctor_step`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.config.render import profile_gres
from orchestrator.supervise.doctor import NODE_NAME_VAR

if TYPE_CHECKING:
    from orchestrator.config.profile.load import ClusterProfile

#: The step's time limit, minutes: the checks take seconds; this bounds a node that hangs in them.
DOCTOR_TIME_LIMIT_MIN = 5


def doctor_srun(profile: ClusterProfile, nodes: int, script: str) -> list[str]:
    """``srun`` for the profile's partition, account, QOS, GPUs, memory and constraint, ``--label``
    (each line starts with its task's number), the node's Slurm name in :data:`NODE_NAME_VAR` and
    submitit's environment name, so the node's part finds its place in the step as a job's does."""
    optional = {
        "--partition": profile.partition,
        "--account": profile.account,
        "--qos": profile.qos,
        "--mem": profile.mem,
        "--constraint": profile.constraint,
        "--gres": profile_gres(profile) if profile.gpus_per_node else None,
    }
    preamble = f'export SUBMITIT_EXECUTOR=slurm {NODE_NAME_VAR}="$SLURMD_NODENAME"\n'
    return [
        "srun",
        "--job-name=orchestrator-doctor",
        *(f"{flag}={value}" for flag, value in optional.items() if value),
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={profile.cpus_per_task}",
        f"--time={DOCTOR_TIME_LIMIT_MIN}",
        "--kill-on-bad-exit=0",
        "--unbuffered",
        "--label",
        "--quiet",
        "bash",
        "-c",
        preamble + script,
        "orchestrator-doctor",
    ]
