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

Every function checks its arguments first (:mod:`orchestrator.api.door`, the CLI's checks): a wrong
type or value is a :class:`UserError` naming the call and the argument, before anything is created;
a ``home`` given to a call that reads must hold a registry (never a new empty one made there).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.api import door
from orchestrator.api import follow as at_login
from orchestrator.api.doctor import doctor
from orchestrator.api.door import JOB_ID, SWEEP_ID
from orchestrator.api.handles import NOT_RESUMED, Job, Sweep, cancel, get_job, get_sweep, resume
from orchestrator.api.runs import cost, export, logs, plot, stacks
from orchestrator.config import inputs
from orchestrator.config.job_request import JobRequest, PlanKeywords
from orchestrator.contract.errors import UserError
from orchestrator.remote import handles as remote
from orchestrator.remote.handles import RemoteJob, RemoteSweep
from orchestrator.runner.progress import WAIT_UNTIL, NoCheckpoint, WaitTimeout, follow_hint
from orchestrator.runner.sweep_status import SWEEP_METRICS, SweepStatus, sweep_status

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; read by the type checker only

    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.profile.load import ClusterProfile
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.registry.sweeps import SweepRecord
    from orchestrator.runner.resume import ResumeOverrides
    from orchestrator.runner.status import StatusReport
    from orchestrator.runner.status import StatusRow as StatusRow
    from orchestrator.schedulers.base import Request


__all__ = [
    "NOT_RESUMED",
    "WAIT_UNTIL",
    "SWEEP_METRICS",
    "Job",
    "Sweep",
    "SweepStatus",
    "WaitTimeout",
    "NoCheckpoint",
    "cancel",
    "check_profile",
    "cost",
    "doctor",
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

    with door.door("parse_after"):
        inputs.text("text", text, "a dependency such as '1234' or '1234:any' (a string)")
    return parse(text)


# ---------------------------------------------------------------------------- the registry
def open_registry(home: Path | str | None = None, *, create: bool = True) -> Registry:
    """The registry under ``home`` (default ``$ORCHESTRATOR_HOME``), open; close it (``with``).
    ``create``: make it when the folder has none (``False``: a UserError naming ``home``)."""
    from orchestrator.registry.store import Registry

    with door.door("open_registry"):
        inputs.path_text("home", home, optional=True)
        inputs.flag("create", create)
    return Registry.open(None if home is None else Path(home), create=create)


def reconcile(registry: Registry | None = None, home: Path | str | None = None) -> list[str]:
    """Settle submissions a killed ``submit`` left half done (adopt or clean up); a line for each."""
    from orchestrator.runner.submission import reconcile_pending

    registry, home = door.checked("reconcile", registry, home)
    with door.using(registry, home) as reg:
        return reconcile_pending(reg)


def list_jobs(
    state: JobState | str | None = None,
    since: float | None = None,
    registry: Registry | None = None,
    home: Path | str | None = None,
) -> list[JobRecord]:
    """Registry rows (no scheduler query), oldest first: only in ``state`` / submitted since ``since``."""
    from orchestrator.contract.job_states import JobState, parse_state

    with door.door("list_jobs"):
        if state is not None and not isinstance(state, JobState):
            inputs.text("state", state, "a job state such as 'RUNNING' (a string or a JobState)")
            try:
                parse_state(str(state))
            except ValueError as exc:
                raise UserError(f"state: {exc}") from None
        since = inputs.number("since", since)
    registry, home = door.checked("list_jobs", registry, home)
    with door.using(registry, home) as reg:
        return reg.list_jobs(state=state, since=since)


def list_sweeps(registry: Registry | None = None, home: Path | str | None = None) -> list[SweepRecord]:
    """Every sweep in the registry, newest first."""
    registry, home = door.checked("list_sweeps", registry, home)
    with door.using(registry, home) as reg:
        return reg.list_sweeps()


def find_sweep(
    sweep_id: str, registry: Registry | None = None, home: Path | str | None = None
) -> SweepRecord | None:
    """The sweep with this id, or None when the id is not a sweep's."""
    with door.door("find_sweep"):
        inputs.text("sweep_id", sweep_id, SWEEP_ID)
    registry, home = door.checked("find_sweep", registry, home)
    with door.using(registry, home) as reg:
        return reg.find_sweep(sweep_id)


def get_sweep_record(
    sweep_id: str, registry: Registry | None = None, home: Path | str | None = None
) -> SweepRecord:
    """The sweep's registry record (its tasks, grid points and jobs); an unknown id is a user error."""
    with door.door("get_sweep_record"):
        inputs.text("sweep_id", sweep_id, SWEEP_ID)
    registry, home = door.checked("get_sweep_record", registry, home)
    with door.using(registry, home) as reg:
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

    with door.door("plan_request"):
        inputs.instance("request", request, JobRequest, "a JobRequest")
    return plan(request)


def check_profile(name: str, path: Path, profile: ClusterProfile) -> None:
    """Refuse a profile whose own defaults make a plan ``render`` would refuse (the file and key named)."""
    from orchestrator.config.profile.load import ClusterProfile
    from orchestrator.runner.planning import check_profile_defaults

    with door.door("check_profile"):
        inputs.text("name", name, "a profile name (a non-empty string)")
        inputs.path_text("path", path)
        inputs.instance("profile", profile, ClusterProfile, "a ClusterProfile")
    check_profile_defaults(name, path, profile)


def init_profile(
    name: str,
    *,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    setup: Sequence[str] = (),
    python: str | None = None,
    profiles_dir: Path | str | None = None,
    probe_node: bool = True,
    print_only: bool = False,
    force: bool = False,
    gpu_type: str | None = None,
    out: TextIO | None = None,
) -> tuple[str, Path | None]:
    """``profiles init``: a Slurm profile written from what the cluster says; its text and file.
    ``gpu_type``: which of the partition's GPU types to draft (default: the one on most nodes);
    ``out`` (default nowhere) gets what was chosen when the partition has several."""
    from orchestrator.runner.profile_init import init_profile as init

    with door.door("init_profile"):
        inputs.text("name", name, "a profile name (a non-empty string)")
        for label, value in (("partition", partition), ("account", account), ("qos", qos)):
            if value is not None:
                inputs.text(label, value, f"a Slurm {label} name")
        if gpu_type is not None:
            inputs.text("gpu_type", gpu_type, "a GPU type of the partition's GRES (a100, h100)")
        inputs.path_text("python", python, optional=True)
        inputs.path_text("profiles_dir", profiles_dir, optional=True)
        inputs.stream("out", out)
    folder = None if profiles_dir is None else str(profiles_dir)
    answers = {"partition": partition, "account": account, "qos": qos, "python": python, "gpu_type": gpu_type}
    return init(name, answers, [str(line) for line in setup], folder, probe_node, print_only, force, out)


def render_files(plan: LaunchPlan, node_rank: int | None = None, python: str | None = None) -> dict[str, str]:
    """What ``render`` shows: file name -> text (batch script for a SAMPLE run directory, node configs)."""
    from orchestrator.runner.rendering import render_files as render

    with door.door("render_files"):
        _plan("plan", plan)
        inputs.whole("node_rank", node_rank, 0)
        inputs.path_text("python", python, optional=True)
    return render(plan, node_rank, python or sys.executable)


def resume_plan(
    previous: LaunchPlan,
    **overrides: Unpack[ResumeOverrides],
) -> LaunchPlan:
    """The plan a resume of ``previous`` submits (None: as before)."""
    from orchestrator.runner.resume import resume_plan as plan

    with door.door("resume_plan"):
        _plan("previous", previous)
        checked = door.resume_overrides("resume_plan", overrides)
    return plan(previous, **checked)


# ---------------------------------------------------------------------------- jobs
def submit_plan(plan: LaunchPlan, *, snapshot: bool = False, registry: Registry | None = None) -> Job:
    """Submit a checked plan (``submit``'s one path); the job and its run directory."""
    from orchestrator.runner.submission import submit as submit_

    with door.door("submit_plan"):
        _plan("plan", plan)
        inputs.flag("snapshot", snapshot)
        door.registry(registry)
    reg = registry if registry is not None else open_registry()
    submitted = submit_(plan, snapshot=snapshot, registry=reg)
    return Job(submitted.job_id, submitted.run_dir, reg.path.parent)


def dry_run(plan: LaunchPlan) -> Request:
    """The request ``submit`` would make for ``plan`` now (``submit --dry-run`` prints it)."""
    from orchestrator.runner.submission import dry_run as dry_run_

    with door.door("dry_run"):
        _plan("plan", plan)
    return dry_run_(plan)


def start_estimate(plan: LaunchPlan) -> str | None:
    """When the scheduler would start ``plan`` now, without submitting (``submit --test-only``):
    Slurm's own line (``Job N to start at TIME using ... on nodes ...``); None on ``local``."""
    from orchestrator.runner.submission import start_estimate as estimate

    with door.door("start_estimate"):
        _plan("plan", plan)
    return estimate(plan)


def submit(*, snapshot: bool = False, **plan: Unpack[PlanKeywords]) -> Job | RemoteJob:
    """Submit a job; the keywords are :func:`make_plan`'s (``script``, ``profile``, ``strategy``,
    ``nodes``, ``after``...). A profile with ``login.host``: a :class:`RemoteJob` on that login host."""
    with door.door("submit"):
        inputs.flag("snapshot", snapshot)
    request = JobRequest.from_keywords(plan, "submit")
    if remote.has_login(request):
        return remote.submit(request, snapshot)
    return submit_plan(plan_request(request), snapshot=snapshot)


def status(
    job_ids: Sequence[str] = (),
    *,
    timeout_s: float = 5.0,
    registry: Registry | None = None,
    home: Path | str | None = None,
) -> StatusReport | None:
    """``status``: a row per job (one batched scheduler query); no ids: the active and recent jobs.
    None when no job is selected. Jobs submitted through a login host: that host's rows."""
    from orchestrator.runner.status import StatusReport, collect_status, select_jobs

    with door.door("status"):
        job_ids = inputs.texts("job_ids", job_ids)
        timeout_s = inputs.seconds("timeout_s", timeout_s, optional=False) or timeout_s
    registry, home = door.checked("status", registry, home)
    if registry is None and home is None and (at := at_login.one_login("status", job_ids)) is not None:
        return at_login.status(at, job_ids, timeout_s)  # submitted through a login host: asked there
    with door.using(registry, home) as reg:
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
    home: Path | str | None = None,
    until: str = "end",
) -> JobState:
    """Follow the job (into the job its run continues as) to its end; its final state. Progress lines
    go to ``out`` (default nowhere); ``timeout`` seconds passed: :class:`WaitTimeout` (its ``job_id``
    and last ``state``). ``until="checkpoint"``: only until the run has a complete checkpoint, and the
    job's state then; a run that ended without one raises :class:`NoCheckpoint`. A job submitted
    through a login host is followed there."""
    import io
    import time

    from orchestrator.runner.progress import WAIT_UNTIL, wait_for_job

    with door.door("wait"):
        inputs.text("job_id", job_id, JOB_ID)
        poll = inputs.seconds("poll", poll, optional=False) or poll
        timeout = inputs.seconds("timeout", timeout)
        inputs.stream("out", out)
        inputs.choice("until", until, WAIT_UNTIL)
    registry, home = door.checked("wait", registry, home)
    if (at := at_login.login_of(job_id, registry, home)) is not None:
        return at_login.wait(at, job_id, poll, timeout, out, until)  # submitted through a login host
    deadline = None if timeout is None else time.monotonic() + timeout
    with door.using(registry, home) as reg:
        job = reg.get(job_id)  # an unknown id: a user error
        return wait_for_job(
            reg, job.job_id, poll_s=poll, out=out or io.StringIO(), deadline=deadline, until=until
        )


def wait_sweep(
    sweep_id: str,
    *,
    poll: float = 2.0,
    timeout: float | None = None,
    out: TextIO | None = None,
    home: Path | str | None = None,
) -> JobState:
    """``wait SWEEP``: progress lines (to ``out``) until every task ended; COMPLETED when every task's
    run completed, FAILED otherwise; ``timeout`` passed: :class:`WaitTimeout`."""
    import io
    import time

    from orchestrator.runner.sweep_status import sweep_outcome, wait_for_sweep

    with door.door("wait_sweep"):
        inputs.text("sweep_id", sweep_id, SWEEP_ID)
        poll = inputs.seconds("poll", poll, optional=False) or poll
        timeout = inputs.seconds("timeout", timeout)
        inputs.stream("out", out)
        home = door.home(home)
    deadline = None if timeout is None else time.monotonic() + timeout
    with door.using(None, home) as reg:
        status = wait_for_sweep(reg, sweep_id, poll, out or io.StringIO(), deadline)
    outcome = sweep_outcome(status)
    assert outcome is not None
    return outcome


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
    from orchestrator.config.inputs import grid as check_grid
    from orchestrator.config.inputs import max_parallel as check_max_parallel
    from orchestrator.runner.sweep_submit import dry_run_sweep as dry_run_

    with door.door("dry_run_sweep"):
        _plan("base", base)
        grid = check_grid(grid)
        limit = check_max_parallel(max_parallel)
    return dry_run_(base, grid, limit or math.prod(len(v) for v in grid.values()))


def submit_sweep_plan(
    base: LaunchPlan,
    grid: Mapping[str, Sequence[str]],
    max_parallel: int | None,
    registry: Registry | None = None,
) -> Sweep:
    from orchestrator.config.inputs import grid as check_grid
    from orchestrator.config.inputs import max_parallel as check_max_parallel
    from orchestrator.runner.sweep_submit import submit_sweep

    with door.door("submit_sweep_plan"):
        _plan("base", base)
        grid = check_grid(grid)
        limit = check_max_parallel(max_parallel)
        door.registry(registry)
    reg = registry if registry is not None else open_registry()
    done = submit_sweep(base, grid, limit or math.prod(len(v) for v in grid.values()), reg)
    return Sweep(done.sweep_id, done.sweep_dir, reg.path.parent)


def sweep(
    *, grid: Mapping[str, Sequence[Any]], max_parallel: int | None = None, **plan: Unpack[PlanKeywords]
) -> Sweep | RemoteSweep:
    """A grid of runs as one job array: ``args`` name grid values as ``{lr}``; at most
    ``max_parallel`` tasks run at once (default: all). The keywords are :func:`make_plan`'s."""
    from orchestrator.config.inputs import grid as check_grid
    from orchestrator.config.inputs import max_parallel as check_max_parallel

    check_max_parallel(max_parallel)  # before the plan: nothing is created for a refused sweep
    check_grid(grid)  # and before a login host is asked
    request = JobRequest.from_keywords(plan, "sweep")
    if remote.has_login(request):
        return remote.sweep(request, grid, max_parallel)
    base, text_grid = sweep_plan_points(grid, **plan)
    return submit_sweep_plan(base, text_grid, max_parallel)


def _plan(name: str, value: object) -> LaunchPlan:
    from orchestrator.config.plan import LaunchPlan

    return inputs.instance(name, value, LaunchPlan, "a LaunchPlan (api.make_plan(...))")


def _show_request_keywords(func: Callable[..., Any]) -> None:
    """``help(func)`` and editors list the request's keywords in place of ``**plan`` (derived from
    :class:`JobRequest`, as the keywords ``func`` accepts are)."""
    own = inspect.signature(func)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    keywords = inspect.signature(JobRequest).parameters.values()
    setattr(func, "__signature__", own.replace(parameters=[*kept, *keywords]))  # noqa: B010


for _func in (make_plan, submit, sweep, sweep_plan_points):
    _show_request_keywords(_func)
