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

from orchestrator.config.profile.records import time_minutes
from orchestrator.config.scheduler_kinds import SCHEDULER_KINDS
from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import (
    SBATCH_FILE,
    SUBMITIT_DIR,
    write_cancel_marker,
)
from orchestrator.schedulers.base import (
    NodeEnvironment,
    Request,
    Scheduled,
    Scheduler,
    node_task,
    submission_token,
)
from orchestrator.schedulers.slurm.environment import (
    SCANCEL_TIMEOUT_S,
    SINFO_TIMEOUT_S,
    expand_hostlist,
    job_nodes,
    partition_node_cpus,
    srun_on_every_node,
)
from orchestrator.schedulers.slurm.query import SOURCE_RANKS
from orchestrator.schedulers.slurm.states import normalize_slurm_state

if TYPE_CHECKING:
    import signal

    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.profile.load import ClusterProfile
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.schedulers.query import Allocation, QueryResult


# ---------------------------------------------------------------------------- submission side
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


def write_oci_bundle(plan: LaunchPlan, run_dir: Path) -> None:
    """The run's OCI bundle for ``srun --container`` (``orchestrator.config.container.oci_bundle_files``)."""
    import json

    from orchestrator.config.container import oci_bundle_files, oci_bundle_path

    bundle = Path(oci_bundle_path(str(run_dir)))
    config, entries = oci_bundle_files(plan, str(run_dir))
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    for name, target in entries:
        if target is None:
            (bundle / "rootfs" / name).mkdir(exist_ok=True)
        else:
            (bundle / "rootfs" / name).symlink_to(target)
    (bundle / "config.json").write_text(json.dumps(config, indent=1) + "\n")


class SlurmScheduler(Scheduler):
    kind = SCHEDULER_KINDS["slurm"]
    source_ranks = SOURCE_RANKS
    normalize_state = staticmethod(normalize_slurm_state)

    def dryrun(
        self, plan: LaunchPlan, run_dir: Path, attempt_base: int = 0, python: str | None = None
    ) -> Request:
        from orchestrator.config.container import check_submittable
        from orchestrator.config.render import render_sbatch

        # What ``check`` refuses of the container (a missing mount source), so that ``render`` and
        # ``submit --dry-run``, which ask the cluster nothing, say what ``submit`` will say.
        check_submittable(plan)
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
        from orchestrator.config.container import check_submittable

        assert plan.profile.partition is not None  # the profile's own check: slurm needs a partition
        check_submittable(plan)
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

        plan, run_dir = request.plan, request.run_dir
        (run_dir / request.file_name).write_text(request.materialize())
        if plan.profile.container.runtime == "oci":
            write_oci_bundle(plan, run_dir)
        executor = _template_executor(request)(
            folder=run_dir / SUBMITIT_DIR, max_num_timeout=plan.max_requeues
        )
        executor.update_parameters(
            nodes=plan.nodes, ntasks_per_node=1, time=max(1, time_minutes(plan.time_limit))
        )
        task = node_task(run_dir=str(run_dir), scheduler=self.name, attempt_base=request.attempt_base)
        try:
            job = executor.submit(task)
        except subprocess.CalledProcessError as exc:
            output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output
            raise RunFailure(f"sbatch refused the job: {(output or '').strip() or exc}") from None
        return Scheduled(job_id=str(job.job_id), scheduler_job_id=str(job.job_id), handle=job)

    def dryrun_array(
        self, plans: Sequence[LaunchPlan], sweep_dir: Path, max_parallel: int, python: str | None = None
    ) -> Request | None:
        from orchestrator.config.container import check_submittable
        from orchestrator.schedulers.slurm.array import array_request

        for plan in plans:
            check_submittable(plan)
        return array_request(plans, sweep_dir, max_parallel, python)

    def check_array(self, tasks: int) -> None:
        from orchestrator.schedulers.slurm.array import check_array_size

        check_array_size(tasks)

    def schedule_array(
        self, request: Request, task_dirs: Sequence[Path], registry: Registry | None
    ) -> list[Scheduled]:
        from orchestrator.schedulers.slurm.array import submit_array

        if request.plan.profile.container.runtime == "oci":  # one bundle for the sweep's tasks
            write_oci_bundle(request.plan, request.run_dir)
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

    def allocations(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, list[Allocation]] | None:
        from orchestrator.schedulers.slurm.accounting import query_allocations

        return query_allocations(job_ids, timeout_s)

    def start_estimate(self, request: Request) -> str | None:
        """``sbatch --test-only`` of the request's script: Slurm's answer, e.g. ``Job 57 to start at
        2026-11-29T00:40:29 using 8 processors on nodes n[1-2] in partition debug`` (nothing is
        submitted; the job id is one Slurm would give)."""
        import tempfile

        from orchestrator.schedulers.query import run_bounded

        with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=True) as script:
            script.write(request.materialize())
            script.flush()
            res = run_bounded(["sbatch", "--test-only", script.name], SCANCEL_TIMEOUT_S)
        said = (res.stderr + res.stdout).strip().splitlines()
        line = next((s.removeprefix("sbatch: ").strip() for s in said if " to start at " in s), None)
        if line is not None:
            return line
        if res.error is not None or res.returncode != 0:
            why = said[-1].removeprefix("sbatch: ") if said else (res.error or f"exit {res.returncode}")
            raise RunFailure(f"sbatch --test-only refused the job: {why}")
        return None

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
        from orchestrator.schedulers.slurm.node import SlurmNodeEnvironment

        return SlurmNodeEnvironment()

    def job_nodes(self, job_id: str) -> list[str]:
        return job_nodes(job_id)

    def on_every_node(self, nodes: list[str], job_id: str | None = None) -> list[str] | None:
        return srun_on_every_node(nodes, job_id)

    def doctor_step(self, profile: ClusterProfile, nodes: int, script: str) -> list[str]:
        from orchestrator.schedulers.slurm.doctor_step import doctor_srun

        return doctor_srun(profile, nodes, script)
