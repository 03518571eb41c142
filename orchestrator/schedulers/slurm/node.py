"""A task of a Slurm job step, one per node: its place in the job, node 0's address, and what it does
when training ends (``scontrol requeue``, or a successor job with ``requeue_as: new_job``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.contract.errors import RunFailure
from orchestrator.contract.run_dir import MAIN_IP_FILE
from orchestrator.contract.shared_fs import read_text_listed
from orchestrator.schedulers.base import NodeEnvironment, failed_node
from orchestrator.schedulers.slurm.environment import (
    MAIN_IP_WAIT_S,
    batch_job_id,
    batch_restarts,
    interface_address,
    step_attempt,
    step_hostnames,
    step_nodes,
)

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan


#: A Slurm job's node folder (``contract.memory_checkpoints.node_memory_ckpt_dir`` with
#: :attr:`SlurmNodeEnvironment.memory_key`): the run's hash, the job id, the allocation, the host.
_MEMORY_FOLDER = re.compile(r"^[0-9a-f]{12}-(?P<job>\d+(?:_\d+)?)-a\d+-(?P<host>[A-Za-z0-9._-]+)$")


def ended_jobs_folders(names: list[str], host: str, own_job: str, alive: set[str] | None) -> list[str]:
    """Pure: the names among ``names`` (a user's memory checkpoint folders) of other jobs' folders on
    ``host`` whose job is not in ``alive`` (the user's jobs that hold an allocation; None: every
    other job's). A node task killed with SIGKILL (a job past its time limit and ``KillWait``, the
    OOM killer) or a cancel between a failure and the next step could not remove its folder, and
    ``/dev/shm`` is the node's memory until it reboots: the user's next job on the node removes it.
    A pending job's folders go too: a requeued job's next allocation never reads them (its keys are
    new). Other hosts' folders are theirs to judge (the test cluster's nodes share one ``/dev/shm``)."""
    found = []
    for name in names:
        match = _MEMORY_FOLDER.match(name)
        if match is None or match["host"] != host or match["job"] == own_job:
            continue
        if alive is None or match["job"] not in alive:
            found.append(name)
    return found


class SlurmNodeEnvironment(NodeEnvironment):
    """A task of a Slurm job step: one per node."""

    def __init__(self) -> None:
        import submitit

        env = submitit.JobEnvironment()
        self.node_rank = env.global_rank
        self.num_nodes = env.num_tasks
        # The step's nodes, not the allocation's: with spare nodes the step runs on some of them.
        self.hostnames = step_hostnames() or list(env.hostnames)
        self.shrunk_to = step_nodes()
        self.job_id = batch_job_id() or str(env.job_id)
        self.restarts = batch_restarts()

    def attempt(self, attempt_base: int) -> int:
        """The batch step's number for this step (a restart inside the allocation is a new attempt),
        else the submission's plus Slurm's requeues."""
        attempt = step_attempt()
        return attempt if attempt is not None else super().attempt(attempt_base)

    def main_ip(self, plan: LaunchPlan, attempt_path: Path) -> str:
        """Without a named interface every node resolves node 0's hostname itself. With one (ib0,
        eth0 in a namespace) only node 0 can read its address: it publishes it in the shared run
        directory and the others wait for it."""
        import socket

        interface = plan.profile.network_interface
        if not interface:
            return socket.gethostbyname(self.hostnames[0])
        published = attempt_path / MAIN_IP_FILE
        if self.is_first_node:
            ip = interface_address(interface)
            tmp = published.with_suffix(".tmp")
            tmp.write_text(ip)
            os.replace(tmp, published)
            return ip
        deadline = time.monotonic() + MAIN_IP_WAIT_S
        while time.monotonic() < deadline:
            text = read_text_listed(published)  # written on node 0's host (orchestrator.contract.shared_fs)
            if text:
                return text.strip()
            time.sleep(0.2)
        raise RunFailure(
            f"node 0 ({self.hostnames[0]}) did not publish its {interface} address within {MAIN_IP_WAIT_S:.0f} s"
        )

    @property
    def memory_key(self) -> str:
        """The allocation (Slurm's requeue count) and the host: after a spare took a lost node's place
        the survivors' node ranks move, their memory stays where it was."""
        return f"a{self.restarts}-{self.host}"

    @property
    def host(self) -> str:
        return os.environ.get("SLURMD_NODENAME") or self.hostnames[self.node_rank]

    def memory_outlives_task(self, plan: LaunchPlan) -> bool:
        """With spare nodes a lost node is followed by a new step on the same allocation: the
        survivors' memory checkpoints, and the copies of the lost node's, are what it resumes from
        (the batch step removes them when it ends)."""
        return plan.profile.spare_nodes > 0

    def stale_memory_keys(self) -> list[str]:
        return [f"a{n}-{self.host}" for n in range(self.restarts)]

    def ended_jobs_memory(self, user_dir: Path) -> list[Path]:
        """This user's memory checkpoint folders on this host of Slurm jobs that hold no allocation any
        more (:func:`ended_jobs_folders`), by one ``squeue`` of the user's jobs; none when it fails."""
        import subprocess

        try:
            names = os.listdir(user_dir)
        except OSError:
            return []
        if not ended_jobs_folders(names, self.host, self.job_id, None):
            return []  # no other job's folder here: no squeue
        try:
            out = subprocess.run(
                ["squeue", "-h", "-u", str(os.getuid()), "-o", "%A %i %T"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return []
        alive = {
            job for line in out.splitlines() if line.split()[2:3] != ["PENDING"] for job in line.split()[:2]
        }
        return [user_dir / name for name in ended_jobs_folders(names, self.host, self.job_id, alive)]

    def keeps_launchers(self, plan: LaunchPlan | None = None) -> bool:
        """When the batch step marked the step (``RESTART_IN_PLACE_ENV``): it restarts in place, so
        it will give the word."""
        from orchestrator.contract.env import RESTART_IN_PLACE_ENV

        return os.environ.get(RESTART_IN_PLACE_ENV) == "1"

    def failed_peer(self, attempt_path: Path) -> tuple[int, int] | None:
        """In a step restarted in place a node whose ranks failed keeps its task, so srun's
        kill-on-bad-exit never ends the others: each looks at the attempt's exit files."""
        return failed_node(attempt_path, self.num_nodes, self.node_rank) if self.keeps_launchers() else None

    def told_to_stop(self, attempt_path: Path) -> str | None:
        """The batch step's stop word after a hang (``stop_ranks.json``), in a step restarted in place."""
        from orchestrator.contract.in_place import stop_ranks_file
        from orchestrator.contract.shared_fs import read_json_listed

        if not self.keeps_launchers():
            return None
        word = read_json_listed(stop_ranks_file(attempt_path))  # written on the batch host
        return None if word is None else str(word.get("why") or "the batch step asked")

    def finish(self, plan: LaunchPlan, run_dir: Path, attempt: int, code: int) -> bool:
        """Node 0 requeues the job when training asked for it. Other nodes leave it to node 0: failing
        first would make ``srun --kill-on-bad-exit`` kill node 0 before it ran ``scontrol requeue``.
        With ``requeue_as: new_job`` node 0 submits a successor instead (True: handed over)."""
        from orchestrator.config.container import IN_CONTAINER_ENV
        from orchestrator.contract.run_dir import EXIT_REQUEUE

        if code != EXIT_REQUEUE or not self.is_first_node:
            return False
        if os.environ.get(IN_CONTAINER_ENV):
            # A user's image has no Slurm commands: the batch step, on the host, acts once the step ends.
            print("[orchestrator node] requeue left to the batch step (inside a container image)", flush=True)
            return False
        from orchestrator.schedulers.slurm.auto_resume import act_on_requeue

        return act_on_requeue(plan, run_dir, self.job_id, self.restarts, attempt)
