"""What a scheduler answers about jobs, and running its commands: bounded in time, never hanging.

Every scheduler's :meth:`~orchestrator.schedulers.base.Scheduler.query` answers in these records;
every subprocess runs in its own session with a deadline; on expiry the whole process group is
killed, so a wrapper script that left a grandchild holding the pipe cannot hang us either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.contract.job_states import JobState

#: Where a state came from. Each scheduler names its own sources and ranks them
#: (:attr:`~orchestrator.schedulers.base.Scheduler.source_ranks`: its live queue before its history);
#: these two are every scheduler's.
Source = str
#: A recorded end, not asked about again (:mod:`orchestrator.runner.refresh`).
FINAL_SOURCE: Source = "final"
#: The registry's last word, when the scheduler did not answer: stale.
REGISTRY_SOURCE: Source = "registry"
#: Rank of the shared sources: lower is more authoritative (live), higher is staler.
SHARED_SOURCE_RANKS: Mapping[Source, int] = {FINAL_SOURCE: 0, REGISTRY_SOURCE: 2}


@dataclass(frozen=True)
class SchedulerState:
    """What one source said about one job. Empty strings from Slurm become None."""

    job_id: str
    state: JobState
    raw_state: str
    source: Source
    stale: bool = False
    reason: str | None = None
    node_list: str | None = None
    exit_code: str | None = None
    start: str | None = None
    end: str | None = None
    elapsed: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "job_id": self.job_id,
            "state": self.state.value,
            "raw_state": self.raw_state,
            "source": self.source,
            "stale": self.stale,
            "reason": self.reason,
            "node_list": self.node_list,
            "exit_code": self.exit_code,
            "start": self.start,
            "end": self.end,
            "elapsed": self.elapsed,
        }


@dataclass(frozen=True)
class QueryResult:
    """States for the ids asked. ``source`` is the least authoritative source any answer came from
    (the scheduler's live queue < its history < the registry); ``stale`` is True if any answer is not
    live scheduler data. ``calls``: how many times each scheduler command ran."""

    states: dict[str, SchedulerState]
    source: Source
    stale: bool
    errors: tuple[str, ...] = ()
    calls: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Allocation:
    """One allocation a job held, as the scheduler's accounting recorded it (``cost``): a job the
    scheduler requeued under its id has one per incarnation. Times are epoch seconds; ``end`` is
    None while it runs, ``start`` None while it waits. ``gpus``/``cpus``: allocated in total."""

    job_id: str
    submit: float | None
    start: float | None
    end: float | None
    gpus: int
    cpus: int
    nodes: int
    state: str

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CommandResult:
    """Outcome of one bounded subprocess. ``error`` is set when it did not run to a clean exit."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    error: str | None = None


def run_bounded(argv: Sequence[str], timeout_s: float) -> CommandResult:
    """Run ``argv`` with a hard deadline and return what it printed; never raises for the usual
    failures (missing binary, non-zero exit, timeout) -- they come back in ``error``.

    The child gets its own session so that on timeout we can kill its whole process group
    (``subprocess.run`` kills only the direct child and then waits on pipes a grandchild may hold).
    """
    argv_t = tuple(argv)
    name = os.path.basename(argv_t[0])
    timeout_s = max(0.05, timeout_s)
    try:
        proc = subprocess.Popen(
            argv_t,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except FileNotFoundError:
        return CommandResult(argv_t, None, "", "", f"{name} not found on PATH")
    except OSError as exc:
        return CommandResult(argv_t, None, "", "", f"{name} could not start: {exc.strerror or exc}")
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            # Something outside the group still holds the pipes; abandon them rather than hang.
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            proc.wait(timeout=1.0)
            out, err = "", ""
        return CommandResult(
            argv_t, proc.returncode, out or "", err or "", f"{name} timed out after {timeout_s:.1f}s"
        )
    if proc.returncode != 0:
        first = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
        return CommandResult(
            argv_t, proc.returncode, out, err, f"{name} exited {proc.returncode}: {first}".rstrip(": ")
        )
    return CommandResult(argv_t, 0, out, err)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


#: What Slurm prints for "no value".


#: What a record built without its ``__init__`` (:func:`state_record`) gets by default.
STATE_DEFAULTS = {"stale": False, "exit_code": None, "end": None}


def state_record(**fields: object) -> SchedulerState:
    """A :class:`SchedulerState` built through ``__dict__``, not the frozen ``__init__``: thousands of
    rows per ``status`` call."""
    state = SchedulerState.__new__(SchedulerState)
    state.__dict__.update(STATE_DEFAULTS, **fields)
    return state


def combine(
    states: dict[str, SchedulerState],
    errors: list[str],
    calls: dict[str, int],
    ranks: Mapping[Source, int] = SHARED_SOURCE_RANKS,
    empty: Source = FINAL_SOURCE,
) -> QueryResult:
    """One result: ``ranks`` orders the schedulers' own sources (the shared ones are added);
    ``empty``: the source said when no job was asked about."""
    order = {**SHARED_SOURCE_RANKS, **ranks}
    worst = max(states.values(), key=lambda s: order.get(s.source, 0)).source if states else empty
    stale = any(s.stale for s in states.values())
    return QueryResult(states=states, source=worst, stale=stale, errors=tuple(errors), calls=calls)
