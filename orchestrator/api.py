"""The Python API: submit, follow and change jobs and sweeps from a notebook or a pipeline.

::

    import orchestrator

    job = orchestrator.submit(profile="slurm_a100", strategy="full_shard", script="train.py",
                              args=["--lr", "3e-4"], nodes=2)
    job.wait()                      # the final JobState (COMPLETED, FAILED, ...)
    job.metrics()[-1]               # the last event of metrics.jsonl

The command line is built on these functions (``submit``, ``sweep``, ``cancel``, ``resume`` call
them), so both take one path: the same checks, the same run directory, the same registry rows.
Importing this module imports neither torch nor accelerate; what a call needs is imported by it.
"""

from __future__ import annotations

import argparse
import io
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    import signal

    from orchestrator.cli.status import StatusRow
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry
    from orchestrator.schedulers.base import Request
    from orchestrator.schedulers.query import QueryResult

__all__ = [
    "Job",
    "Sweep",
    "cancel",
    "get_job",
    "get_sweep",
    "parse_after",
    "make_plan",
    "resume",
    "submit",
    "submit_plan",
    "sweep",
]

_AFTER = re.compile(r"^([0-9A-Za-z_.-]+?)(?::(ok|any))?$")


def parse_after(text: str) -> str:
    """``JOB`` or ``JOB:ok`` -> ``afterok:JOB``; ``JOB:any`` -> ``afterany:JOB`` (Slurm's words)."""
    m = _AFTER.match(text.strip())
    if not m:
        raise UserError(f"--after {text!r}: expected JOB, JOB:ok or JOB:any (JOB: a job or sweep id)")
    return f"after{m.group(2) or 'ok'}:{m.group(1)}"


def _registry(registry: Registry | None) -> Registry:
    from orchestrator.registry.store import Registry

    return registry if registry is not None else Registry.open()


# ---------------------------------------------------------------------------- planning
def make_plan(
    *,
    script: str,
    args: Sequence[str] = (),
    profile: str | None = None,
    strategy: str | None = None,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    name: str | None = None,
    time: str | None = None,
    max_requeues: int | None = None,
    auto_resume: bool = False,
    exclude: str | None = None,
    after: Sequence[str] = (),
    profiles_dir: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> LaunchPlan:
    """The checked plan of a job, exactly as ``submit`` builds it from its flags. ``options``: strategy
    options by name (``{"mixed_precision": "bf16"}``), the ``--`` flags of ``orchestrator submit``."""
    from orchestrator.cli.plan_args import plan_from_args
    from orchestrator.config.options import OPTIONS

    known = {o.name for o in OPTIONS}
    given = dict(options or {})
    unknown = sorted(set(given) - known)
    if unknown:
        raise UserError(f"options: unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")
    if strategy is not None:
        given["strategy"] = strategy
    values = argparse.Namespace(
        profile=profile or os.environ.get("ORCHESTRATOR_PROFILE", "local"),
        profiles_dir=profiles_dir,
        nodes=nodes,
        procs_per_node=procs_per_node,
        name=name,
        time=time,
        max_requeues=max_requeues,
        auto_resume=auto_resume,
        exclude=exclude,
        after=list(after),
        script_and_args=[script, *args],
        script_required=True,
        **{o.name: given.get(o.name) for o in OPTIONS},
    )
    return plan_from_args(values)


# ---------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class Job:
    """A submitted job: its id in the registry and its run directory. Each method asks afresh."""

    job_id: str
    run_dir: Path
    _home: Path | None = field(default=None, repr=False, compare=False)

    def _open(self) -> Registry:
        from orchestrator.registry.store import Registry

        return Registry.open(self._home)

    def status(self, timeout_s: float = 5.0) -> StatusRow:
        """State (one scheduler query) and training progress, as one row of ``orchestrator status``."""
        from orchestrator.cli.status import collect_status

        with self._open() as registry:
            rows, _ = collect_status(registry, [registry.get(self.job_id)], timeout_s=timeout_s)
        return rows[0]

    def wait(self, timeout: float | None = None, poll: float = 2.0, out: TextIO | None = None) -> JobState:
        """Follow the job (into the job its run continues as) to its end; its final state. ``out``:
        where progress lines go (default nowhere). ``timeout`` passed: :class:`TimeoutError`."""
        import time

        from orchestrator.core.progress import WaitTimeout, wait_for_job

        deadline = None if timeout is None else time.monotonic() + timeout
        with self._open() as registry:
            try:
                return wait_for_job(
                    registry, self.job_id, poll_s=poll, out=out or io.StringIO(), deadline=deadline
                )
            except WaitTimeout as exc:
                raise TimeoutError(str(exc)) from None

    def logs(self, node: int = 0, attempt: int | None = None) -> str:
        """The node entry point's log (launcher and rank output) of one attempt (default: the last)."""
        from orchestrator.contract.run_dir import attempt_dirs, node_log_file

        attempts = dict(attempt_dirs(self.run_dir))
        if not attempts:
            return ""
        chosen = max(attempts) if attempt is None else attempt
        if chosen not in attempts:
            raise UserError(f"job {self.job_id}: no attempt {chosen} (attempts: {sorted(attempts)})")
        path = node_log_file(attempts[chosen], node)
        return path.read_text(errors="replace") if path.exists() else ""

    def metrics(self) -> list[dict[str, Any]]:
        """Every complete event of the run's metrics.jsonl (train, eval, resume...)."""
        from orchestrator.core.run_summary import iter_metrics

        return list(iter_metrics(self.run_dir))

    def cancel(self, signal: signal.Signals | str | None = None) -> str:
        """Cancel the job, or send it ``signal`` (e.g. ``"USR1"``); the line ``cancel`` prints."""
        return cancel(self.job_id, signal, home=self._home)

    def resume(self, **overrides: Any) -> Job:
        """A new job in the same run directory from its last complete checkpoint (``nodes``,
        ``procs_per_node``, ``strategy``, ``profile``, ``profiles_dir`` may change)."""
        return resume(self.job_id, home=self._home, **overrides)[0]


def get_job(job_id: str, home: Path | None = None) -> Job:
    from orchestrator.registry.store import Registry

    with Registry.open(home) as registry:
        record = registry.get(job_id)
    return Job(record.job_id, Path(record.run_dir), home)


def submit_plan(plan: LaunchPlan, *, snapshot: bool = False, registry: Registry | None = None) -> Job:
    """Submit a checked plan (``submit``'s one path); the job and its run directory."""
    from orchestrator.core.submission import submit as submit_

    reg = _registry(registry)
    submitted = submit_(plan, snapshot=snapshot, registry=reg)
    return Job(submitted.job_id, submitted.run_dir, reg.path.parent)


def dry_run(plan: LaunchPlan) -> Request:
    """The request ``submit`` would make for ``plan`` now (``submit --dry-run`` prints it)."""
    from orchestrator.core.submission import dry_run as dry_run_

    return dry_run_(plan)


def submit(*, script: str, args: Sequence[str] = (), snapshot: bool = False, **kwargs: Any) -> Job:
    """Submit a job; the keywords are :func:`make_plan`'s (``profile``, ``strategy``, ``nodes``, ``after``...)."""
    return submit_plan(make_plan(script=script, args=args, **kwargs), snapshot=snapshot)


def cancel(job_id: str, sig: signal.Signals | str | None = None, home: Path | None = None) -> str:
    """Cancel a job (or signal it), under its run's lock; the line to print."""
    from contextlib import AbstractContextManager, nullcontext

    from orchestrator.cli.cancel import cancel_job, parse_signal
    from orchestrator.core.run_lock import RunLocked, run_lock
    from orchestrator.registry.store import Registry

    signum = parse_signal(sig) if isinstance(sig, str) else sig
    with Registry.open(home) as registry:
        job = registry.get(job_id)
        guard: AbstractContextManager[None] = (
            run_lock(job.run_dir, timeout_s=60.0, what=f"cancel {job.job_id}")
            if job.run_dir.is_dir()
            else nullcontext()
        )
        try:
            with guard:
                return cancel_job(registry, job, signum)
        except RunLocked as exc:
            raise UserError(f"job {job.job_id}: {exc}; try again when it is done") from None


def resume(job_id: str, home: Path | None = None, **overrides: Any) -> tuple[Job, list[str]]:
    """``orchestrator resume``: the new job and the lines the command prints."""
    from orchestrator.cli.resume import resume_job
    from orchestrator.registry.store import Registry

    allowed = {"nodes", "procs_per_node", "strategy", "profile", "profiles_dir"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise UserError(f"resume: unknown keyword {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    values = argparse.Namespace(job_id=job_id, **{k: overrides.get(k) for k in sorted(allowed)})
    with Registry.open(home) as registry:
        new_job_id, lines = resume_job(registry, values)
        record = registry.get(new_job_id)
    return Job(new_job_id, Path(record.run_dir), home), lines


# ---------------------------------------------------------------------------- sweeps
@dataclass(frozen=True)
class SweepStatus:
    """``status SWEEP``: a row per started task, and the best task by ``metric``."""

    sweep_id: str
    rows: list[StatusRow]
    params: list[dict[str, str]]
    result: QueryResult
    metric: str
    best: int | None
    """Index into ``rows`` of the best task (None when no task has the metric yet)."""
    tasks: list[int] = field(default_factory=list)
    """The task number of each row."""
    queued: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    """Tasks of a local sweep not started yet (waiting for a free slot), with their parameters."""

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.rows:
            out[row.state.value] = out.get(row.state.value, 0) + 1
        if self.queued:
            out["QUEUED"] = len(self.queued)
        return out


#: Metrics of a status row a sweep can be ranked by, and whether higher is better.
SWEEP_METRICS = {"loss": False, "val_loss": False, "tokens_per_s": True}


@dataclass(frozen=True)
class Sweep:
    sweep_id: str
    sweep_dir: Path
    _home: Path | None = field(default=None, repr=False, compare=False)

    @property
    def jobs(self) -> list[Job]:
        """The tasks' jobs in task order (a local sweep's tasks appear as they start)."""
        from orchestrator.registry.store import Registry

        with Registry.open(self._home) as registry:
            record = registry.get_sweep(self.sweep_id)
            by_id = {j.job_id: j for j in registry.get_many(record.job_ids)}
        return [Job(t.job_id, Path(by_id[t.job_id].run_dir), self._home) for t in record.tasks]

    def status(self, metric: str = "loss", timeout_s: float = 5.0) -> SweepStatus:
        """Every task's row (one scheduler query for the whole sweep) and the best by ``metric``."""
        from orchestrator.registry.store import Registry

        with Registry.open(self._home) as registry:
            return sweep_status(registry, self.sweep_id, metric, timeout_s)

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> dict[str, JobState]:
        """Every task's final state, by job id (a local sweep's later tasks are waited for as they start)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        states: dict[str, JobState] = {}
        while True:
            jobs = [j for j in self.jobs if j.job_id not in states]
            if not jobs and len(states) >= self._task_count():
                return states
            if not jobs:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"sweep {self.sweep_id}: tasks not started after {timeout} s")
                time.sleep(poll)
                continue
            for job in jobs:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
                states[job.job_id] = job.wait(timeout=left, poll=poll)

    def _task_count(self) -> int:
        from orchestrator.contract.run_dir import CANCEL_MARKER, SWEEP_FILE, read_json

        if (self.sweep_dir / CANCEL_MARKER).exists():
            return len(self.jobs)
        return len((read_json(self.sweep_dir / SWEEP_FILE) or {}).get("tasks", []))

    def resume_failed(self, **overrides: Any) -> list[tuple[int, Job | None, list[str]]]:
        """``resume SWEEP --failed``: each task whose run ended other than COMPLETED resumed from its
        own last complete checkpoint, as a job of its own (``(task, new job or None, lines)``; a task
        that cannot be resumed, e.g. no checkpoint, gets None and the reason)."""
        done: list[tuple[int, Job | None, list[str]]] = []
        status = self.status()
        for i, row in zip(status.tasks, status.rows, strict=True):
            state = row.run_state or row.state
            if not state.is_terminal() or state.is_success():
                continue
            try:
                job, lines = resume(row.continued_as or row.job_id, home=self._home, **overrides)
            except UserError as exc:
                done.append((i, None, [f"task {i}: not resumed: {exc}"]))
                continue
            done.append((i, job, [f"task {i}: {line}" for line in lines]))
        return done

    def cancel(self) -> list[str]:
        """Cancel every task still going (and start no more of a local sweep's)."""
        import getpass

        from orchestrator.contract.run_dir import write_cancel_marker

        write_cancel_marker(self.sweep_dir, "CANCEL", getpass.getuser())
        lines = []
        for job in self.jobs:
            try:
                lines.append(job.cancel())
            except UserError as exc:  # already ended
                lines.append(str(exc))
        return lines


def sweep_status(
    registry: Registry, sweep_id: str, metric: str = "loss", timeout_s: float = 5.0
) -> SweepStatus:
    from orchestrator.cli.status import collect_status

    if metric not in SWEEP_METRICS:
        raise UserError(f"--metric {metric!r}: expected one of {', '.join(SWEEP_METRICS)}")
    record = registry.get_sweep(sweep_id)
    rows, result = collect_status(registry, registry.get_many(record.job_ids), timeout_s=timeout_s)
    higher = SWEEP_METRICS[metric]
    scored = [(getattr(r, metric), i) for i, r in enumerate(rows) if getattr(r, metric) is not None]
    best = (max(scored) if higher else min(scored))[1] if scored else None
    started = {t.task for t in record.tasks}
    from orchestrator.contract.run_dir import CANCEL_MARKER, SWEEP_FILE, read_json

    planned = (read_json(record.sweep_dir / SWEEP_FILE) or {}).get("tasks", [])
    queued = [(int(t["task"]), dict(t["params"])) for t in planned if int(t["task"]) not in started]
    if (record.sweep_dir / CANCEL_MARKER).exists():
        queued = []  # a cancelled local sweep starts no more tasks
    return SweepStatus(
        sweep_id,
        rows,
        [t.params for t in record.tasks],
        result,
        metric,
        best,
        [t.task for t in record.tasks],
        queued,
    )


def get_sweep(sweep_id: str, home: Path | None = None) -> Sweep:
    from orchestrator.registry.store import Registry

    with Registry.open(home) as registry:
        record = registry.get_sweep(sweep_id)
        return Sweep(record.sweep_id, record.sweep_dir, home)


def sweep_plan_points(
    grid: Mapping[str, Sequence[Any]], *, script: str, args: Sequence[str] = (), **kwargs: Any
) -> tuple[LaunchPlan, dict[str, list[str]]]:
    """The base plan and the grid as text (``{"lr": [1e-3, 3e-4]}`` -> ``["0.001", "0.0003"]``)."""
    from orchestrator.config.sweep_plan import parse_grid

    specs = [f"{k}=" + ",".join(str(v) for v in values) for k, values in grid.items()]
    return make_plan(script=script, args=args, **kwargs), parse_grid(specs)


def submit_sweep_plan(
    base: LaunchPlan,
    grid: Mapping[str, Sequence[str]],
    max_parallel: int | None,
    registry: Registry | None = None,
) -> Sweep:
    from orchestrator.core.sweep_submit import submit_sweep

    reg = _registry(registry)
    tasks = 1
    for values in grid.values():
        tasks *= len(values)
    done = submit_sweep(base, grid, max_parallel or tasks, reg)
    return Sweep(done.sweep_id, done.sweep_dir, reg.path.parent)


def sweep(
    *,
    grid: Mapping[str, Sequence[Any]],
    script: str,
    args: Sequence[str] = (),
    max_parallel: int | None = None,
    **kwargs: Any,
) -> Sweep:
    """A grid of runs as one job array: ``args`` name grid values as ``{lr}``; at most
    ``max_parallel`` tasks run at once (default: all). The keywords are :func:`make_plan`'s."""
    base, text_grid = sweep_plan_points(grid, script=script, args=args, **kwargs)
    return submit_sweep_plan(base, text_grid, max_parallel)
