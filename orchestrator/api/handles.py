"""``Job`` and ``Sweep``: handles on submitted work, by id and folder. Each method asks afresh
(the registry, the scheduler, the run directory); :mod:`orchestrator.api` hands them out.

Every method checks its arguments first (:mod:`orchestrator.api.door`): a refusal is a
:class:`UserError` naming the call and the argument, and nothing is created (a handle's ``home``
without a registry is refused, never given a new empty one).

Importing this module imports no registry and no scheduler (``import orchestrator.api`` stays light).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.api import door
from orchestrator.api import follow as at_login
from orchestrator.api.door import JOB_ID, SWEEP_ID
from orchestrator.config import inputs
from orchestrator.contract.errors import UserError
from orchestrator.remote import handles as remote
from orchestrator.remote.handles import RemoteJob

if TYPE_CHECKING:
    import signal
    from typing import Unpack

    from orchestrator.contract.job_states import JobState
    from orchestrator.registry.store import Registry
    from orchestrator.rundir.series import SeriesFollower
    from orchestrator.runner.resume import ResumeOverrides
    from orchestrator.runner.status import StatusRow
    from orchestrator.runner.sweep_status import SweepStatus


@dataclass(frozen=True)
class Job:
    """A submitted job: its id in the registry and its run directory. Each method asks afresh."""

    job_id: str
    run_dir: Path
    _home: Path | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        with door.door("Job"):
            inputs.text("job_id", self.job_id, JOB_ID)
            object.__setattr__(self, "run_dir", Path(inputs.path_text("run_dir", self.run_dir) or ""))
            home = inputs.path_text("home", self._home, optional=True)
        object.__setattr__(self, "_home", None if home is None else Path(home))

    def _open(self, caller: str) -> Registry:
        return _open(caller, self._home)

    def status(self, timeout_s: float = 5.0) -> StatusRow:
        """State (one scheduler query) and training progress, as one row of ``orchestrator status``."""
        from orchestrator.runner.status import collect_status

        with door.door("Job.status"):
            timeout_s = inputs.seconds("timeout_s", timeout_s, optional=False) or timeout_s
        with self._open("Job.status") as registry:
            rows, _ = collect_status(registry, [registry.get(self.job_id)], timeout_s=timeout_s)
        return rows[0]

    def wait(
        self, timeout: float | None = None, poll: float = 2.0, out: TextIO | None = None, until: str = "end"
    ) -> JobState:
        """Follow the job (into the job its run continues as) to its end; its final state. ``out``:
        where progress lines go (default nowhere). ``timeout`` passed: :class:`TimeoutError`.
        ``until="checkpoint"``: only until its run has a complete checkpoint, and the job's state
        then; a run that ended without one raises :class:`NoCheckpoint`."""
        import time

        from orchestrator.runner.progress import WAIT_UNTIL, WaitTimeout, wait_for_job

        with door.door("Job.wait"):
            poll = inputs.seconds("poll", poll, optional=False) or poll
            timeout = inputs.seconds("timeout", timeout)
            inputs.stream("out", out)
            inputs.choice("until", until, WAIT_UNTIL)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._open("Job.wait") as registry:
            try:
                return wait_for_job(
                    registry,
                    self.job_id,
                    poll_s=poll,
                    out=out or io.StringIO(),
                    deadline=deadline,
                    until=until,
                )
            except WaitTimeout as exc:
                raise TimeoutError(str(exc)) from None

    def logs(self, node: int = 0, attempt: int | None = None) -> str:
        """The node entry point's log (launcher and rank output) of one attempt (default: the last)."""
        from orchestrator.contract.run_dir import attempt_dirs, node_log_file

        with door.door("Job.logs"):
            inputs.whole("node", node, 0, optional=False)
            inputs.whole("attempt", attempt, 0)
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
        from orchestrator.rundir.summary import iter_metrics

        return list(iter_metrics(self.run_dir))

    def curves(self) -> SeriesFollower:
        """The run's loss and throughput curves, followed: ``.update().series()`` parses only what was
        appended since the previous call (``orchestrator ui`` keeps one per open run page)."""
        from orchestrator.rundir.series import SeriesFollower

        return SeriesFollower(self.run_dir)

    def details(self) -> dict[str, Any]:
        """What the run directory says beyond the status row: the attempts and their nodes, the
        straggler ranks, the newest hang report with every rank's stack (None without one)."""
        from orchestrator.rundir import view as run_view

        return {
            "attempts": run_view.attempts(self.run_dir),
            "stragglers": run_view.stragglers(self.run_dir),
            "hang": run_view.hang_report(self.run_dir),
        }

    def cancel(self, signal: signal.Signals | str | None = None) -> str:
        """Cancel the job, or send it ``signal`` (e.g. ``"USR1"``); the line ``cancel`` prints."""
        door.checked_home("Job.cancel", self._home)
        return cancel(self.job_id, signal, home=self._home)

    def resume(
        self,
        **overrides: Unpack[ResumeOverrides],
    ) -> Job:
        """A new job in the same run directory from its last complete checkpoint (None: as before)."""
        with door.door("Job.resume"):
            door.resume_overrides("Job.resume", overrides)
            door.home(self._home)
        return resume(
            self.job_id,
            home=self._home,
            **overrides,
        )[0]


def _open(caller: str, home: Path | str | None) -> Registry:
    """The registry under ``home`` (None: ``$ORCHESTRATOR_HOME``, made when missing); an explicit
    ``home`` without one is refused, naming ``caller`` and ``home``, and none is made there."""
    from orchestrator.registry.store import Registry

    return Registry.open(door.checked_home(caller, home), create=home is None)


def get_job(job_id: str, home: Path | str | None = None) -> Job | RemoteJob:
    """The handle of a job of the registry; an unknown id is a user error. A job submitted through a
    login host (:mod:`orchestrator.api.follow`): a :class:`RemoteJob` on it."""
    with door.door("get_job"):
        inputs.text("job_id", job_id, JOB_ID)
    home = door.checked_home("get_job", home)
    if (at := at_login.login_of(job_id, None, home)) is not None:
        return remote.job_of(at, job_id)
    with _open("get_job", home) as registry:
        record = registry.get(job_id)
    return Job(record.job_id, Path(record.run_dir), home)


def cancel(job_id: str, sig: signal.Signals | str | None = None, home: Path | str | None = None) -> str:
    """Cancel a job (or signal it), under its run's lock; the line to print."""
    from orchestrator.config.inputs import signal_value
    from orchestrator.runner.cancel import cancel_locked

    with door.door("cancel"):
        inputs.text("job_id", job_id, JOB_ID)
    signum = signal_value(sig)  # 0, "5s", 1.5: refused, as `cancel --signal` refuses them
    if (at := at_login.login_of(job_id, None, home)) is not None:
        return at_login.cancel(at, job_id, signum)
    with _open("cancel", home) as registry:
        return cancel_locked(registry, job_id, signum)


def resume(
    job_id: str,
    home: Path | str | None = None,
    **overrides: Unpack[ResumeOverrides],
) -> tuple[Job, list[str]]:
    """``orchestrator resume``: the new job and the lines the command prints."""
    from orchestrator.runner.resume import resume_job

    with door.door("resume"):
        inputs.text("job_id", job_id, JOB_ID)
        checked = door.resume_overrides("resume", overrides)
    home = door.checked_home("resume", home)
    if (at := at_login.login_of(job_id, None, home)) is not None:
        raise at_login.refuse("resume", job_id, at, "resume")
    with _open("resume", home) as registry:
        new_job_id, lines = resume_job(registry, job_id, **checked)
        record = registry.get(new_job_id)
    return Job(new_job_id, Path(record.run_dir), home), lines


#: How :meth:`Sweep.resume_failed` words a task it could not resume (after "task N: ").
NOT_RESUMED = "not resumed: "


@dataclass(frozen=True)
class Sweep:
    sweep_id: str
    sweep_dir: Path
    _home: Path | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        with door.door("Sweep"):
            inputs.text("sweep_id", self.sweep_id, SWEEP_ID)
            object.__setattr__(self, "sweep_dir", Path(inputs.path_text("sweep_dir", self.sweep_dir) or ""))
            home = inputs.path_text("home", self._home, optional=True)
        object.__setattr__(self, "_home", None if home is None else Path(home))

    @property
    def jobs(self) -> list[Job]:
        """The tasks' jobs in task order (a local sweep's tasks appear as they start)."""
        with _open("Sweep.jobs", self._home) as registry:
            record = registry.get_sweep(self.sweep_id)
            by_id = {j.job_id: j for j in registry.get_many(record.job_ids)}
        return [Job(t.job_id, Path(by_id[t.job_id].run_dir), self._home) for t in record.tasks]

    def status(self, metric: str = "loss", timeout_s: float = 5.0) -> SweepStatus:
        """Every task's row (one scheduler query for the whole sweep) and the best by ``metric``."""
        from orchestrator.runner.sweep_status import SWEEP_METRICS, sweep_status

        with door.door("Sweep.status"):
            inputs.choice("metric", metric, SWEEP_METRICS)
            timeout_s = inputs.seconds("timeout_s", timeout_s, optional=False) or timeout_s
        with _open("Sweep.status", self._home) as registry:
            return sweep_status(registry, self.sweep_id, metric, timeout_s)

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> dict[str, JobState]:
        """Every task's final state, by job id (a local sweep's later tasks are waited for as they start)."""
        import time

        with door.door("Sweep.wait"):
            poll = inputs.seconds("poll", poll, optional=False) or poll
            timeout = inputs.seconds("timeout", timeout)
        door.checked_home("Sweep.wait", self._home)
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

    def resume_failed(
        self,
        **overrides: Unpack[ResumeOverrides],
    ) -> list[tuple[int, Job | None, list[str]]]:
        """``resume SWEEP --failed``: each task whose run ended other than COMPLETED resumed from its
        own last complete checkpoint, as a job of its own (``(task, new job or None, lines)``; a task
        that cannot be resumed, e.g. no checkpoint, gets None and a line "task N: not resumed: ...").
        The tasks of a local sweep whose starter died before starting them are handed to a new
        starter, which starts them ``max_parallel`` at a time from their plans in ``sweep.json``
        (None, and a line "task N: ... new starter ...")."""
        from orchestrator.runner import local_sweep

        with door.door("Sweep.resume_failed"):
            door.resume_overrides("Sweep.resume_failed", overrides)
            door.home(self._home)
        done: list[tuple[int, Job | None, list[str]]] = []
        status = self.status()
        for i, row in zip(status.tasks, status.rows, strict=True):
            state = row.run_state or row.state
            if not state.is_terminal() or state.is_success():
                continue
            try:
                job, lines = resume(
                    row.continued_as or row.job_id,
                    home=self._home,
                    **overrides,
                )
            except UserError as exc:
                done.append((i, None, [f"task {i}: {NOT_RESUMED}{exc}"]))
                continue
            done.append((i, job, [f"task {i}: {line}" for line in lines]))
        if status.not_started:
            pid = local_sweep.start(self.sweep_dir, self.sweep_id)
            for i, _params, _reason in status.not_started:
                line = f"task {i}: never started (the sweep's starter had ended); a new starter (pid {pid}) starts it"
                done.append((i, None, [line]))
        return sorted(done, key=lambda d: d[0])

    def cancel(self) -> list[str]:
        """Cancel every task still going (and start no more of a local sweep's)."""
        import getpass

        from orchestrator.contract.run_dir import write_cancel_marker

        door.checked_home("Sweep.cancel", self._home)
        write_cancel_marker(self.sweep_dir, "CANCEL", getpass.getuser())
        lines = []
        for job in self.jobs:
            try:
                lines.append(job.cancel())
            except UserError as exc:  # already ended
                lines.append(str(exc))
        return lines


def get_sweep(sweep_id: str, home: Path | str | None = None) -> Sweep:
    """The handle of a sweep of the registry; an unknown id is a user error."""
    with door.door("get_sweep"):
        inputs.text("sweep_id", sweep_id, SWEEP_ID)
    home = door.checked_home("get_sweep", home)
    with _open("get_sweep", home) as registry:
        record = registry.get_sweep(sweep_id)
        return Sweep(record.sweep_id, record.sweep_dir, home)
