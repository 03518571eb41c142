"""The Python API: submit, follow and change jobs and sweeps from a notebook or a pipeline.

::

    import orchestrator

    job = orchestrator.submit(profile="slurm_a100", strategy="full_shard", script="train.py",
                              args=["--lr", "3e-4"], nodes=2)
    job.wait()                      # the final JobState (COMPLETED, FAILED, ...)
    job.metrics()[-1]               # the last event of metrics.jsonl

The command line is built on these functions (each command parses its flags, calls them, prints):
one path, the same checks, run directories and registry rows. Importing this module imports no
torch, accelerate, registry or scheduler; a call imports what it needs. ``registry``: an open one
to use (a command asking several things opens it once); else the one under ``home`` is opened.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.api.handles import NOT_RESUMED, Job, Sweep, cancel, get_job, get_sweep, resume
from orchestrator.config.job_request import JobRequest, PlanKeywords
from orchestrator.contract.errors import UserError
from orchestrator.remote import handles as remote
from orchestrator.remote.handles import RemoteJob, RemoteSweep
from orchestrator.runner.progress import WaitTimeout, follow_hint
from orchestrator.runner.sweep_status import SWEEP_METRICS, SweepStatus, sweep_status

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; read by the type checker only

    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.profile.load import ClusterProfile
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.registry.sweeps import SweepRecord
    from orchestrator.runner.cost import CostReport
    from orchestrator.runner.export import Exported
    from orchestrator.runner.resume import ResumeOverrides
    from orchestrator.runner.stacks import Stacks
    from orchestrator.runner.status import StatusReport
    from orchestrator.runner.status import StatusRow as StatusRow
    from orchestrator.schedulers.base import Request


__all__ = [
    "NOT_RESUMED",
    "SWEEP_METRICS",
    "Job",
    "Sweep",
    "SweepStatus",
    "WaitTimeout",
    "cancel",
    "check_profile",
    "cost",
    "dry_run",
    "dry_run_sweep",
    "export",
    "find_sweep",
    "follow_hint",
    "get_job",
    "get_sweep",
    "get_sweep_record",
    "list_jobs",
    "list_sweeps",
    "logs",
    "make_plan",
    "open_registry",
    "parse_after",
    "plan_request",
    "plot",
    "reconcile",
    "render_files",
    "resume",
    "resume_plan",
    "stacks",
    "status",
    "submit",
    "submit_plan",
    "sweep",
    "sweep_status",
    "wait",
]


def parse_after(text: str) -> str:
    """``JOB`` or ``JOB:ok`` -> ``afterok:JOB``; ``JOB:any`` -> ``afterany:JOB`` (Slurm's words)."""
    from orchestrator.config.job_request import parse_after as parse

    return parse(text)


# ---------------------------------------------------------------------------- the registry
def open_registry(home: Path | None = None) -> Registry:
    """The registry under ``home`` (default ``$ORCHESTRATOR_HOME``), open; close it (``with``)."""
    from orchestrator.registry.store import Registry

    return Registry.open(home)


@contextmanager
def _using(registry: Registry | None, home: Path | None = None) -> Iterator[Registry]:
    """``registry`` as it is, or the one under ``home`` opened for the call and closed after it."""
    if registry is not None:
        yield registry
        return
    with open_registry(home) as opened:
        yield opened


def reconcile(registry: Registry | None = None, home: Path | None = None) -> list[str]:
    """Settle submissions a killed ``submit`` left half done (adopt or clean up); a line for each."""
    from orchestrator.runner.submission import reconcile_pending

    with _using(registry, home) as reg:
        return reconcile_pending(reg)


def list_jobs(
    state: JobState | str | None = None,
    since: float | None = None,
    registry: Registry | None = None,
    home: Path | None = None,
) -> list[JobRecord]:
    """Registry rows (no scheduler query), oldest first: only in ``state`` / submitted since ``since``."""
    with _using(registry, home) as reg:
        return reg.list_jobs(state=state, since=since)


def list_sweeps(registry: Registry | None = None, home: Path | None = None) -> list[SweepRecord]:
    """Every sweep in the registry, newest first."""
    with _using(registry, home) as reg:
        return reg.list_sweeps()


def find_sweep(
    sweep_id: str, registry: Registry | None = None, home: Path | None = None
) -> SweepRecord | None:
    """The sweep with this id, or None when the id is not a sweep's."""
    with _using(registry, home) as reg:
        return reg.find_sweep(sweep_id)


def get_sweep_record(
    sweep_id: str, registry: Registry | None = None, home: Path | None = None
) -> SweepRecord:
    """The sweep's registry record (its tasks, grid points and jobs); an unknown id is a user error."""
    with _using(registry, home) as reg:
        return reg.get_sweep(sweep_id)


# ---------------------------------------------------------------------------- planning
def make_plan(**keywords: Unpack[PlanKeywords]) -> LaunchPlan:
    """The checked plan of a job, exactly as ``submit`` builds it from its flags. The keywords, each
    one field of :class:`orchestrator.config.job_request.JobRequest`: ``script`` (required), ``args``,
    ``profile``, ``nodes``, ``strategy``... ``options``: strategy options by name
    (``{"mixed_precision": "bf16"}``), the ``--`` flags of ``orchestrator submit``;
    ``container_image``: this job's image instead of the profile's ``container.image``."""
    return plan_request(JobRequest.from_keywords(keywords, "make_plan"))


def plan_request(request: JobRequest) -> LaunchPlan:
    """:func:`make_plan` of a request already built (the command line's flags build one)."""
    from orchestrator.runner.planning import plan_request as plan

    return plan(request)


def check_profile(name: str, path: Path, profile: ClusterProfile) -> None:
    """Refuse a profile whose own defaults make a plan ``render`` would refuse (the file and key named)."""
    from orchestrator.runner.planning import check_profile_defaults

    check_profile_defaults(name, path, profile)


def render_files(plan: LaunchPlan, node_rank: int | None = None, python: str | None = None) -> dict[str, str]:
    """What ``render`` shows: file name -> text (batch script for a SAMPLE run directory, node configs)."""
    from orchestrator.runner.rendering import render_files as render

    return render(plan, node_rank, python or sys.executable)


def resume_plan(
    previous: LaunchPlan,
    **overrides: Unpack[ResumeOverrides],
) -> LaunchPlan:
    """The plan a resume of ``previous`` submits (None: as before)."""
    from orchestrator.runner.resume import resume_plan as plan

    return plan(
        previous,
        **overrides,
    )


# ---------------------------------------------------------------------------- jobs
def submit_plan(plan: LaunchPlan, *, snapshot: bool = False, registry: Registry | None = None) -> Job:
    """Submit a checked plan (``submit``'s one path); the job and its run directory."""
    from orchestrator.runner.submission import submit as submit_

    reg = registry if registry is not None else open_registry()
    submitted = submit_(plan, snapshot=snapshot, registry=reg)
    return Job(submitted.job_id, submitted.run_dir, reg.path.parent)


def dry_run(plan: LaunchPlan) -> Request:
    """The request ``submit`` would make for ``plan`` now (``submit --dry-run`` prints it)."""
    from orchestrator.runner.submission import dry_run as dry_run_

    return dry_run_(plan)


def submit(*, snapshot: bool = False, **plan: Unpack[PlanKeywords]) -> Job | RemoteJob:
    """Submit a job; the keywords are :func:`make_plan`'s (``script``, ``profile``, ``strategy``,
    ``nodes``, ``after``...). A profile with ``login.host``: a :class:`RemoteJob` on that login host."""
    request = JobRequest.from_keywords(plan, "submit")
    if remote.has_login(request):
        return remote.submit(request, snapshot)
    return submit_plan(plan_request(request), snapshot=snapshot)


def status(
    job_ids: Sequence[str] = (),
    *,
    timeout_s: float = 5.0,
    registry: Registry | None = None,
    home: Path | None = None,
) -> StatusReport | None:
    """``status``: a row per job (one batched scheduler query); no ids: the active and recent jobs.
    None when no job is selected."""
    from orchestrator.runner.status import StatusReport, collect_status, select_jobs

    with _using(registry, home) as reg:
        jobs = select_jobs(reg, job_ids)
        if not jobs:
            return None
        rows, result = collect_status(reg, jobs, timeout_s=timeout_s)
    return StatusReport(rows, result)


def wait(
    job_id: str,
    *,
    poll: float = 2.0,
    timeout: float | None = None,
    out: TextIO | None = None,
    registry: Registry | None = None,
    home: Path | None = None,
) -> JobState:
    """Follow the job (into the job its run continues as) to its end; its final state. Progress lines
    go to ``out`` (default nowhere); ``timeout`` seconds passed: :class:`WaitTimeout` (its ``job_id``
    and last ``state``)."""
    import io
    import time

    from orchestrator.config.inputs import seconds
    from orchestrator.runner.progress import wait_for_job

    poll = seconds("poll", poll, optional=False) or poll
    timeout = seconds("timeout", timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _using(registry, home) as reg:
        job = reg.get(job_id)  # an unknown id: a user error
        return wait_for_job(reg, job.job_id, poll_s=poll, out=out or io.StringIO(), deadline=deadline)


def wait_sweep(
    sweep_id: str,
    *,
    poll: float = 2.0,
    timeout: float | None = None,
    out: TextIO | None = None,
    home: Path | None = None,
) -> JobState:
    """``wait SWEEP``: progress lines (to ``out``) until every task ended; COMPLETED when every task's
    run completed, FAILED otherwise; ``timeout`` passed: :class:`WaitTimeout`."""
    import io
    import time

    from orchestrator.config.inputs import seconds
    from orchestrator.runner.sweep_status import sweep_outcome, wait_for_sweep

    poll = seconds("poll", poll, optional=False) or poll
    timeout = seconds("timeout", timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    with open_registry(home) as reg:
        status = wait_for_sweep(reg, sweep_id, poll, out or io.StringIO(), deadline)
    outcome = sweep_outcome(status)
    assert outcome is not None
    return outcome


def logs(
    job_id: str,
    *,
    follow: bool = False,
    node: int | None = None,
    rank: int | None = None,
    attempt: int | None = None,
    tail: int | None = None,
    interval: float = 0.25,
    out: TextIO | None = None,
    err: TextIO | None = None,
    home: Path | None = None,
    resume_from: Mapping[str, Any] | None = None,
    framed: bool = False,
) -> JobState | None:
    """``logs``: print the selected node logs (or the last ``tail`` lines of each) to ``out`` (default
    stdout), notes to ``err``. ``follow``: keep printing until the job ends; its final state (None
    without ``follow``). ``framed``/``resume_from``: the resumable stream of ``core.logs.Resume``."""
    from orchestrator.runner.logs import Resume, show_logs

    with open_registry(home) as registry:
        return show_logs(
            registry,
            job_id,
            follow=follow,
            node=node,
            rank=rank,
            attempt=attempt,
            tail=tail,
            interval=interval,
            out=out,
            err=err,
            framed=framed,
            resume_from=Resume(dict(resume_from)) if resume_from else None,
        )


def export(run: str | None, out: str | Path, **options: Any) -> Exported:
    """A run's (job id or run directory) checkpoint as files inference tools read; the keywords and
    what they do: :func:`orchestrator.runner.export.export_run`. Imports torch."""
    from orchestrator.runner.export import export_run

    return export_run(run, Path(out), **options)


def plot(job_id: str, output: str | Path | None = None, home: Path | None = None) -> Path:
    """Loss and throughput of the job's run to a PNG (default ``<run_dir>/plot.png``); the file written."""
    with open_registry(home) as registry:
        job = registry.get(job_id)
    out = Path(output) if output else job.run_dir / "plot.png"
    if out.suffix.lower() != ".png":
        raise UserError(f"-o {out}: only PNG output is supported (name it *.png)")
    if not job.run_dir.is_dir():
        raise UserError(f"run directory {job.run_dir} of job {job.job_id} does not exist")
    if not out.parent.is_dir():
        # Never created here: a mistyped -o path should fail, not grow a tree of folders.
        raise UserError(f"-o {out}: folder {out.parent} does not exist")
    from orchestrator.rundir.plotting import plot_run

    return plot_run(job.run_dir, out, job_id=job.job_id)


def cost(
    target: str, *, whole_run: bool = False, timeout_s: float = 10.0, home: Path | None = None
) -> CostReport:
    """Where the allocated hours of a job, a run (a run directory, or a job with ``whole_run``) or a
    sweep went: productive, lost work, start-up, hang... (:mod:`orchestrator.runner.cost_model`)."""
    from orchestrator.runner.cost import cost_report

    with open_registry(home) as registry:
        return cost_report(registry, target, whole_run=whole_run, timeout_s=timeout_s)


def stacks(job_id: str, home: Path | None = None) -> Stacks:
    """Every rank's Python stack now (py-spy, on the job's nodes), saved in the run directory."""
    from orchestrator.runner.stacks import dump_stacks

    with open_registry(home) as registry:
        job = registry.get(job_id)
    return dump_stacks(job.job_id, Path(job.run_dir), job.scheduler)


# ---------------------------------------------------------------------------- sweeps
def sweep_plan_points(
    grid: Mapping[str, Sequence[Any]], **plan: Unpack[PlanKeywords]
) -> tuple[LaunchPlan, dict[str, list[str]]]:
    """The base plan and the grid as text (``{"lr": [1e-3, 3e-4]}`` -> ``["0.001", "0.0003"]``); the
    keywords are :func:`make_plan`'s."""
    from orchestrator.config.inputs import grid as check_grid

    text_grid = check_grid(grid)  # values are never re-split: "a,b" is one value
    return plan_request(JobRequest.from_keywords(plan, "sweep_plan_points")), text_grid


def dry_run_sweep(
    base: LaunchPlan, grid: Mapping[str, Sequence[str]], max_parallel: int | None = None
) -> tuple[Request | None, list[tuple[dict[str, str], LaunchPlan]]]:
    """What :func:`submit_sweep_plan` would submit now: the array request (None where the scheduler
    has no arrays) and each task's parameters and plan."""
    from orchestrator.config.inputs import max_parallel as check_max_parallel
    from orchestrator.runner.sweep_submit import dry_run_sweep as dry_run_

    limit = check_max_parallel(max_parallel)
    return dry_run_(base, grid, limit or math.prod(len(v) for v in grid.values()))


def submit_sweep_plan(
    base: LaunchPlan,
    grid: Mapping[str, Sequence[str]],
    max_parallel: int | None,
    registry: Registry | None = None,
) -> Sweep:
    from orchestrator.config.inputs import max_parallel as check_max_parallel
    from orchestrator.runner.sweep_submit import submit_sweep

    limit = check_max_parallel(max_parallel)
    reg = registry if registry is not None else open_registry()
    done = submit_sweep(base, grid, limit or math.prod(len(v) for v in grid.values()), reg)
    return Sweep(done.sweep_id, done.sweep_dir, reg.path.parent)


def sweep(
    *, grid: Mapping[str, Sequence[Any]], max_parallel: int | None = None, **plan: Unpack[PlanKeywords]
) -> Sweep | RemoteSweep:
    """A grid of runs as one job array: ``args`` name grid values as ``{lr}``; at most
    ``max_parallel`` tasks run at once (default: all). The keywords are :func:`make_plan`'s."""
    from orchestrator.config.inputs import max_parallel as check_max_parallel

    check_max_parallel(max_parallel)  # before the plan: nothing is created for a refused sweep
    request = JobRequest.from_keywords(plan, "sweep")
    if remote.has_login(request):
        return remote.sweep(request, grid, max_parallel)
    base, text_grid = sweep_plan_points(grid, **plan)
    return submit_sweep_plan(base, text_grid, max_parallel)


def _show_request_keywords(func: Callable[..., Any]) -> None:
    """``help(func)`` and editors list the request's keywords in place of ``**plan`` (derived from
    :class:`JobRequest`, as the keywords ``func`` accepts are)."""
    own = inspect.signature(func)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    keywords = inspect.signature(JobRequest).parameters.values()
    setattr(func, "__signature__", own.replace(parameters=[*kept, *keywords]))  # noqa: B010


for _func in (make_plan, submit, sweep, sweep_plan_points):
    _show_request_keywords(_func)
