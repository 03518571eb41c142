"""Slurm: sbatch through submitit, squeue/sacct for state, scancel, and ``SLURM_*`` on the node.

``socket`` and ``subprocess`` are imported where used: ``render`` loads this module and needs neither.

This module is the only reader of ``SLURM_*`` variables. Submission goes through submitit (its
pickling, its per-task entry ``python -m submitit.core._submit``), but the batch script is ours:
:meth:`SlurmScheduler.dryrun` renders it, and the executor submits that text unchanged.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config.scheduler_kinds import SCHEDULER_KINDS
from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import (
    MAIN_IP_FILE,
    SBATCH_FILE,
    SUBMITIT_DIR,
    cancel_requested,
    write_cancel_marker,
)
from orchestrator.schedulers.base import NodeEnvironment, Request, Scheduled, Scheduler, submission_token

if TYPE_CHECKING:
    import signal

    from orchestrator.config.plan import LaunchPlan
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.schedulers.query import QueryResult

SINFO_TIMEOUT_S = 15.0
SCANCEL_TIMEOUT_S = 30.0
#: How long non-zero nodes wait for node 0 to publish its address.
MAIN_IP_WAIT_S = 120.0
#: The main process address ``render`` shows: the real one is known only on node 0, at run time.
#: Variables an allocation sets that a job submitted from inside it must not inherit.
_INHERITED_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SUBMITIT_")


# ---------------------------------------------------------------------------- the job's environment
def batch_job_id() -> str:
    """This job's id as the registry and Slurm's commands name it: ``<array>_<task>`` for a task of
    a job array (a sweep; ``scontrol requeue`` of that id requeues the task alone)."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID", "")


def batch_restarts() -> int:
    """How often Slurm requeued this job (``SLURM_RESTART_COUNT``; absent on the first run)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def allocation_nodes() -> list[str]:

    import subprocess

    """Host names of this allocation (``SLURM_JOB_NODELIST`` expanded by Slurm itself)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        return []
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    return proc.stdout.split() if proc.returncode == 0 else []


def clean_submit_environment() -> None:
    """sbatch inside an allocation inherits its SLURM_*/SBATCH_* variables (node list, task
    counts, memory): a job submitted from there must be described by its own script only."""
    for name in list(os.environ):
        if name.startswith(_INHERITED_PREFIXES):
            del os.environ[name]


def cancelled_by_user(run_dir: Path, job_id: str) -> str | None:

    import subprocess

    """Why not to requeue: ``orchestrator cancel`` left its marker, or Slurm says CANCELLED (a
    plain ``scancel`` also sends SIGTERM, which training handles like a preemption)."""
    if cancel_requested(run_dir):
        return "cancelled by user (orchestrator cancel)"
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "Slurm reports the job CANCELLED" if out.startswith("CANCELLED") else None


def interface_address(name: str) -> str:

    import socket

    """IPv4 address of a network interface on this host (e.g. ib0)."""
    import psutil

    addrs = psutil.net_if_addrs().get(name)
    if not addrs:
        raise RunFailure(f"network_interface '{name}' does not exist on {socket.gethostname()}")
    for addr in addrs:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise RunFailure(f"network_interface '{name}' on {socket.gethostname()} has no IPv4 address")


class SlurmNodeEnvironment(NodeEnvironment):
    """A task of a Slurm job step: one per node."""

    def __init__(self) -> None:
        import submitit

        env = submitit.JobEnvironment()
        self.node_rank = env.global_rank
        self.num_nodes = env.num_tasks
        self.hostnames = list(env.hostnames)
        self.job_id = batch_job_id() or str(env.job_id)
        self.restarts = batch_restarts()

    def main_ip(self, plan: LaunchPlan, attempt_path: Path) -> str:

        import socket

        """Without a named interface every node resolves node 0's hostname itself. With one (ib0,
        eth0 in a namespace) only node 0 can read its address: it publishes it in the shared run
        directory and the others wait for it."""
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
            if published.exists():
                return published.read_text().strip()
            time.sleep(0.2)
        raise RunFailure(
            f"node 0 ({self.hostnames[0]}) did not publish its {interface} address within {MAIN_IP_WAIT_S:.0f} s"
        )

    def finish(self, plan: LaunchPlan, run_dir: Path, attempt: int, code: int) -> bool:
        """Node 0 requeues the job when training asked for it. Other nodes leave it to node 0: failing
        first would make ``srun --kill-on-bad-exit`` kill node 0 before it ran ``scontrol requeue``.
        With ``requeue_as: new_job`` node 0 submits a successor instead (True: handed over)."""
        import subprocess

        from orchestrator.contract.requeue import decide_requeue
        from orchestrator.contract.run_dir import EXIT_REQUEUE

        if code != EXIT_REQUEUE or not self.is_first_node:
            return False
        if plan.profile.requeue_as == "new_job":
            from orchestrator.schedulers.slurm.auto_resume import continue_in_new_job

            return continue_in_new_job(run_dir, self.job_id, plan, self.restarts)
        decision = decide_requeue(self.restarts, plan.max_requeues, cancelled_by_user(run_dir, self.job_id))
        if not decision.requeue:
            print(f"[orchestrator node] {decision.reason}", file=sys.stderr, flush=True)
            return False
        print(f"[orchestrator node] requeueing job {self.job_id} ({decision.reason})", flush=True)
        subprocess.run(["scontrol", "requeue", self.job_id], check=False, timeout=60)
        return False


# ---------------------------------------------------------------------------- submission side
def partition_node_cpus(partition: str) -> dict[str, int]:
    """``{node: CPUs}`` of a partition's nodes, asking sinfo once (bounded)."""
    import subprocess

    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-p", partition, "-o", "%N %c"],
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise UserError(
            "sinfo not found: this profile needs a Slurm cluster (or use --profile local)"
        ) from None
    except subprocess.TimeoutExpired:
        raise RunFailure(f"sinfo did not answer within {SINFO_TIMEOUT_S:.0f} s: is slurmctld up?") from None
    if proc.returncode != 0:
        raise RunFailure(f"sinfo failed: {proc.stderr.strip() or proc.returncode}")
    nodes: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            nodes[parts[0]] = int(parts[1])
    if not nodes:
        raise UserError(
            f"--profile: partition '{partition}' does not exist on this cluster (sinfo knows nothing of it)"
        )
    return nodes


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list (``n[1-3],gpu01``) expanded by Slurm itself; UserError when it is not one.
    The syntax is checked first: scontrol reads ``zz[1-3`` as ``zz]`` instead of refusing it."""
    import re
    import subprocess

    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text)
    item_re = re.compile(r"[A-Za-z0-9_.-]+(?:\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\][A-Za-z0-9_.-]*)*")
    if not text or ",".join(items) != text or not all(item_re.fullmatch(i) for i in items):
        raise UserError(f"--exclude {text!r}: not a Slurm host list (expected names such as n1,n2 or n[1-4])")

    try:
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunFailure(f"scontrol show hostnames failed: {exc}") from None
    names = proc.stdout.split()
    if proc.returncode != 0 or not names:
        why = (proc.stderr.strip().splitlines() or ["not a host list"])[-1]
        raise UserError(f"--exclude {text!r}: not a Slurm host list ({why})")
    return names


def time_minutes(limit: str) -> int:
    """A Slurm time (``D-HH:MM:SS``, ``HH:MM:SS``, minutes) in whole minutes, rounded up."""
    days = 0
    if "-" in limit:
        d, limit = limit.split("-", 1)
        days = int(d)
    parts = [int(p) for p in limit.split(":")]
    if len(parts) == 1 and days == 0:
        return parts[0]
    while len(parts) < 3:
        parts.append(0)
    hours, minutes, seconds = parts[:3]
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def _template_executor(request: Request) -> Any:
    """A submitit SlurmExecutor that submits the request's text, not a script of its own."""
    import submitit

    after_job = request.extra.get("after_job")

    class RequestExecutor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return request.materialize()

        def _make_submission_command(self, submission_file_path: Any) -> list[str]:
            # A successor (profile key requeue_as: new_job) starts once its predecessor has ended.
            command = list(super()._make_submission_command(submission_file_path))
            if after_job:
                command.insert(1, f"--dependency=afterany:{after_job}")
            return command

    return RequestExecutor


class SlurmScheduler(Scheduler):
    kind = SCHEDULER_KINDS["slurm"]

    def dryrun(
        self, plan: LaunchPlan, run_dir: Path, attempt_base: int = 0, python: str | None = None
    ) -> Request:
        from orchestrator.config.render import render_sbatch

        node_python = plan.profile.python or python or sys.executable
        folder = str(Path(run_dir) / SUBMITIT_DIR)
        text = render_sbatch(plan, str(run_dir), folder, node_python, attempt_base)
        # The submission's token, so a job whose submitting command died is found and adopted.
        token = submission_token(run_dir, attempt_base)
        text = text.replace("#SBATCH ", f"#SBATCH --comment={token}\n#SBATCH ", 1)
        return Request(
            plan=plan,
            run_dir=Path(run_dir),
            text=text,
            file_name=SBATCH_FILE,
            attempt_base=attempt_base,
            extra={"token": token},
        )

    def check(self, plan: LaunchPlan) -> None:
        assert plan.profile.partition is not None  # the profile's own check: slurm needs a partition
        partition = plan.profile.partition
        cpus = partition_node_cpus(partition)
        available = len(cpus)
        if plan.nodes > available:
            raise UserError(
                f"--nodes: {plan.nodes} nodes requested but partition '{partition}' has {available}"
            )
        excluded: set[str] = set()
        for item in plan.exclude_nodes:
            excluded.update(expand_hostlist(item))
        unknown = sorted(excluded - set(cpus))
        if unknown:
            raise UserError(
                f"--exclude {','.join(plan.exclude_nodes)}: {', '.join(unknown)} not in partition '{partition}' "
                f"(its nodes: {', '.join(sorted(cpus))})"
            )
        left = [n for n in cpus if n not in excluded]
        if plan.nodes > len(left):
            raise UserError(
                f"--exclude {','.join(plan.exclude_nodes)}: leaves {len(left)} of partition '{partition}'s {available} nodes, "
                f"but the job needs {plan.nodes}"
            )
        if plan.uses_cpu and plan.profile.max_procs_per_node is None:
            smallest = min(cpus[n] for n in left)
            if plan.procs_per_node > smallest:
                raise UserError(
                    f"--procs-per-node: {plan.procs_per_node} processes per node but partition '{partition}' "
                    f"has nodes with {smallest} CPUs (profile key max_procs_per_node overrides)"
                )

    def schedule(self, request: Request, registry: Registry | None) -> Scheduled:

        import subprocess

        from orchestrator.node.entry import NodeTask

        plan, run_dir = request.plan, request.run_dir
        (run_dir / request.file_name).write_text(request.materialize())
        executor = _template_executor(request)(
            folder=run_dir / SUBMITIT_DIR, max_num_timeout=plan.max_requeues
        )
        executor.update_parameters(
            nodes=plan.nodes, ntasks_per_node=1, time=max(1, time_minutes(plan.time_limit))
        )
        task = NodeTask(run_dir=str(run_dir), scheduler=self.name, attempt_base=request.attempt_base)
        try:
            job = executor.submit(task)
        except subprocess.CalledProcessError as exc:
            output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output
            raise RunFailure(f"sbatch refused the job: {(output or '').strip() or exc}") from None
        return Scheduled(job_id=str(job.job_id), scheduler_job_id=str(job.job_id), handle=job)

    def dryrun_array(
        self, plans: Sequence[LaunchPlan], sweep_dir: Path, max_parallel: int, python: str | None = None
    ) -> Request | None:
        from orchestrator.schedulers.slurm.array import array_request

        return array_request(plans, sweep_dir, max_parallel, python)

    def check_array(self, tasks: int) -> None:
        from orchestrator.schedulers.slurm.array import check_array_size

        check_array_size(tasks)

    def schedule_array(
        self, request: Request, task_dirs: Sequence[Path], registry: Registry | None
    ) -> list[Scheduled]:
        from orchestrator.schedulers.slurm.array import submit_array

        return submit_array(self.name, request, task_dirs)

    def find_submitted(self, tokens: Sequence[str], since: float) -> dict[str, str] | None:
        """squeue for queued and running jobs (``%k``: the comment), then sacct for ended ones
        (needs ``AccountingStoreFlags=job_comment``; without it ended orphans stay unknown)."""
        from orchestrator.schedulers.query import run_bounded

        wanted = set(tokens)
        found: dict[str, str] = {}
        res = run_bounded(["squeue", "-h", "--me", "-o", "%i|%k"], SINFO_TIMEOUT_S)
        if res.error is not None:
            return None
        self._match(res.stdout, wanted, found)
        if len(found) < len(wanted):
            start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
            acct = run_bounded(
                ["sacct", "-X", "-n", "-P", "-S", start, "-o", "JobID,Comment"], SINFO_TIMEOUT_S
            )
            if acct.error is None:  # no accounting: squeue, which knows every job still queued, decides
                self._match(acct.stdout, wanted, found)
        return found

    @staticmethod
    def _match(text: str, wanted: set[str], found: dict[str, str]) -> None:
        for line in text.splitlines():
            job_id, _, comment = line.strip().partition("|")
            if comment in wanted and job_id.isdigit():
                found.setdefault(comment, job_id)

    def adopt(self, run_dir: Path, job_id: str) -> str:
        """submitit renames its task pickle to ``<job>_submitted.pkl`` after sbatch answered; a submit
        killed in between leaves it under its temporary name, and the job would fail waiting for it."""
        import re

        folder = Path(run_dir) / SUBMITIT_DIR
        final = folder / f"{job_id}_submitted.pkl"
        if final.exists():
            return ""
        temporary = [p for p in folder.glob("*.pkl") if re.fullmatch(r"[0-9a-f]{32}\.pkl", p.name)]
        if not temporary:
            return f"submitit's task file for job {job_id} is missing in {folder}"
        newest = max(temporary, key=lambda p: p.stat().st_mtime)
        os.replace(newest, final)
        return ""

    def discard(self, job_id: str, reason: str) -> None:
        from orchestrator.schedulers.query import run_bounded

        run_bounded(["scancel", job_id], SCANCEL_TIMEOUT_S)

    def query(
        self, jobs: Sequence[JobRecord], timeout_s: float, fallback: Mapping[str, JobState]
    ) -> QueryResult:
        from orchestrator.schedulers.slurm.query import query_states

        return query_states([j.job_id for j in jobs], timeout_s=timeout_s, fallback=fallback)

    def cancel(self, job: JobRecord, sig: signal.Signals | None, user: str) -> str:
        from orchestrator.schedulers.query import run_bounded

        argv = ["scancel"]
        if sig is None:
            # scancel sends SIGTERM first, which training cannot tell from a preemption: the marker
            # tells node 0 not to requeue a job the user cancelled.
            try:
                write_cancel_marker(job.run_dir, "CANCEL", user)
            except OSError:
                pass  # run directory gone: nothing left that could requeue it
        else:
            argv.append(f"--signal={sig.name.removeprefix('SIG')}")
        argv.append(job.job_id)
        res = run_bounded(argv, SCANCEL_TIMEOUT_S)
        if res.error is not None:
            raise RunFailure(f"scancel of job {job.job_id} failed: {res.error}")
        return f"sent {sig.name} to job {job.job_id}" if sig else f"cancel requested for job {job.job_id}"

    def log_files(self, run_dir: Path, job_id: str) -> list[Path]:
        return sorted((Path(run_dir) / SUBMITIT_DIR).glob(f"{job_id}_*_log.*"))

    def node_environment(self, job_key: str) -> NodeEnvironment:
        return SlurmNodeEnvironment()
