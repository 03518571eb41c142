"""Ask the scheduler what state jobs are in: one batched call, bounded in time, never hanging.

``status`` over 1,000 jobs must not run 1,000 ``squeue`` processes (each one is an RPC to
slurmctld; a few hundred per second are enough to make a cluster admin unhappy). So:

1. ONE ``squeue -h -j id1,id2,...`` for every id asked;
2. at most ONE ``sacct -j ...`` for the ids squeue no longer knows (finished jobs age out of
   slurmctld after MinJobAge, ~5 min), which also gives exit code, reason, node list and times;
3. for whatever is still unknown -- or if squeue/sacct are missing, fail, or time out -- the
   registry's last known state, and the result is marked ``stale``.

Every subprocess runs in its own session with a deadline; on expiry the whole process group is
killed, so a wrapper script that left a grandchild holding the pipe cannot hang us either.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from orchestrator.contract.errors import OrchestratorError
from orchestrator.contract.job_states import JobState, from_slurm, normalize_slurm_state

if TYPE_CHECKING:
    from orchestrator.registry.store import JobRecord, Registry

Source = Literal["squeue", "sacct", "registry", "run_dir", "final"]

SQUEUE_FORMAT = "%i|%T|%r|%N|%S|%M"
SACCT_FIELDS = "JobID,State,ExitCode,Reason,NodeList,Start,End,Elapsed"
#: Slurm job ids we pass to squeue/sacct: plain, array task (123_4) or het component (123+1).
_SLURM_ID_RE = re.compile(r"^\d+(?:_\d+)?(?:\+\d+)?$")
#: Fraction of ``timeout_s`` squeue may use; sacct gets the rest.
SQUEUE_SHARE = 0.6
_SOURCE_RANK: dict[str, int] = {"squeue": 0, "run_dir": 0, "final": 0, "sacct": 1, "registry": 2}
#: A job recorded in a terminal state at least this long ago is over for good and is not asked
#: about again (source ``final``): Slurm forgets an ended job after MinJobAge (300 s by default),
#: after which nothing -- not even ``scontrol requeue`` -- can bring it back. ``status`` over a
#: registry of thousands of finished jobs thus asks the scheduler only about the live ones.
FINAL_AFTER_S = 3600.0


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
    (squeue < sacct < registry); ``stale`` is True if any answer is not live scheduler data."""

    states: dict[str, SchedulerState]
    source: Source
    stale: bool
    errors: tuple[str, ...] = ()
    calls: dict[str, int] = field(default_factory=dict)


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
_NULLS = frozenset({"", "(null)", "None", "Unknown", "N/A"})


def _opt(text: str) -> str | None:
    text = text.strip()
    return None if text in _NULLS else text


_STATE_DEFAULTS = {"stale": False, "exit_code": None, "end": None}


def parse_squeue(output: str) -> dict[str, SchedulerState]:
    """Parse ``squeue -h -o '%i|%T|%r|%N|%S|%M'`` output."""
    states: dict[str, SchedulerState] = {}
    mapped: dict[str, tuple[JobState, str]] = {}  # a few distinct state words in 1,000 lines
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        if len(parts) < 6:
            parts += [""] * (6 - len(parts))
        job_id, raw, reason, nodes, start, elapsed = map(str.strip, parts[:6])
        known = mapped.get(raw)
        if known is None:
            known = mapped[raw] = (from_slurm(raw), normalize_slurm_state(raw))
        # Not SchedulerState(...): its frozen __init__ is most of the cost of a 1,000-line answer.
        # The fields already stripped, _opt is a set lookup.
        state = states[job_id] = SchedulerState.__new__(SchedulerState)
        state.__dict__.update(
            _STATE_DEFAULTS,
            job_id=job_id,
            state=known[0],
            raw_state=known[1],
            source="squeue",
            reason=None if reason in _NULLS else reason,
            node_list=None if nodes in _NULLS else nodes,
            start=None if start in _NULLS else start,
            elapsed=None if elapsed in _NULLS else elapsed,
        )
    return states


_ARRAY_RANGE_RE = re.compile(r"^(\d+)_\[([0-9,\-]+)(?:%\d+)?\]$")


def _array_task_ids(job_id: str) -> list[str]:
    """``123_[0-3,7%2]`` (sacct's line for array tasks that never started) -> ``123_0`` ... ``123_7``."""
    m = _ARRAY_RANGE_RE.match(job_id)
    if not m:
        return []
    ids: list[str] = []
    for part in m.group(2).split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ids.extend(f"{m.group(1)}_{i}" for i in range(int(first), int(last or first) + 1))
    return ids


def parse_sacct(output: str) -> dict[str, SchedulerState]:
    """Parse ``sacct -n -P -X -o JobID,State,ExitCode,Reason,NodeList,Start,End,Elapsed`` output.

    With ``-X`` there is one line per allocation; if the same id appears twice the later line
    (the most recent incarnation of a requeued job) wins.
    """
    states: dict[str, SchedulerState] = {}
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        parts += [""] * (8 - len(parts))
        job_id, raw, exit_code, reason, nodes, start, end, elapsed = (p.strip() for p in parts[:8])
        if "." in job_id:  # a step (batch/extern/0) slipped through: the allocation line counts
            continue
        for task_id in _array_task_ids(job_id):  # a job array's tasks not yet split: one line
            states[task_id] = SchedulerState(
                job_id=task_id,
                state=from_slurm(raw),
                raw_state=raw.strip(),
                source="sacct",
                reason=_opt(reason),
                node_list=None,
                exit_code=_opt(exit_code),
                start=_opt(start),
                end=_opt(end),
                elapsed=_opt(elapsed),
            )
        states[job_id] = SchedulerState(
            job_id=job_id,
            state=from_slurm(raw),
            raw_state=raw.strip(),
            source="sacct",
            reason=_opt(reason),
            node_list=_opt(nodes) if nodes.strip() != "None assigned" else None,
            exit_code=_opt(exit_code),
            start=_opt(start),
            end=_opt(end),
            elapsed=_opt(elapsed),
        )
    return states


def _squeue_says_none_known(res: CommandResult) -> bool:
    """``squeue -j <one finished id>`` exits 1 with "Invalid job id specified": not a failure,
    just "I don't know this job" -- which sends it on to sacct like any other aged-out id."""
    return res.returncode == 1 and "invalid job id" in res.stderr.lower()


def query_states(
    job_ids: Iterable[str],
    timeout_s: float = 5.0,
    registry: Registry | None = None,
    fallback: Mapping[str, JobState] | None = None,
) -> QueryResult:
    """States of Slurm jobs ``job_ids`` with one squeue call and at most one sacct call.

    ``timeout_s`` bounds the whole query (sacct gets what squeue left). Ids neither tool answers
    fall back to ``fallback[id]``, else the registry's last state, else UNKNOWN -- all stale.
    """
    ids = list(dict.fromkeys(str(j) for j in job_ids))
    deadline = time.monotonic() + timeout_s
    errors: list[str] = []
    calls = {"squeue": 0, "sacct": 0}
    states: dict[str, SchedulerState] = {}
    queryable = [j for j in ids if _SLURM_ID_RE.match(j)]

    if queryable:
        calls["squeue"] += 1
        # squeue gets 60% of the budget so a hung slurmctld still leaves sacct (slurmdbd) a chance.
        res = run_bounded(
            # -r: one line per array task (a sweep's pending tasks are otherwise one "123_[2-9%2]").
            ["squeue", "-h", *(["-r"] if any("_" in j for j in queryable) else []), "-j", ",".join(queryable)]
            + ["-o", SQUEUE_FORMAT],
            timeout_s * SQUEUE_SHARE,
        )
        if res.error is None:
            found = parse_squeue(res.stdout)
            asked = set(queryable)  # once, not per answer: 1,000 ids made this quadratic
            states.update({j: s for j, s in found.items() if j in asked})
        elif not _squeue_says_none_known(res):
            errors.append(res.error)

    missing = [j for j in queryable if j not in states]
    remaining = deadline - time.monotonic()
    if missing and remaining > 0.05:
        calls["sacct"] += 1
        # An array's tasks that never started are one accounting record, found only by the array's id.
        arrays = sorted({j.split("_", 1)[0] for j in missing if "_" in j})
        res = run_bounded(
            ["sacct", "-n", "-P", "-X", "-j", ",".join([*missing, *arrays]), "-o", SACCT_FIELDS], remaining
        )
        if res.error is None:
            found = parse_sacct(res.stdout)
            asked = set(missing)
            states.update({j: s for j, s in found.items() if j in asked})
        else:
            errors.append(res.error)
    elif missing:
        errors.append("no time left for sacct")

    last_known: dict[str, JobState] = dict(fallback or {})
    for job_id in ids:
        if job_id in states:
            continue
        if job_id not in last_known and registry is not None:
            # Unknown to the registry too: report UNKNOWN below.
            with contextlib.suppress(OrchestratorError):
                last_known[job_id] = registry.get(job_id).last_state
        prev = last_known.get(job_id, JobState.UNKNOWN)
        states[job_id] = SchedulerState(
            job_id=job_id, state=prev, raw_state=prev.value, source="registry", stale=True
        )

    return _result(states, errors, calls)


def _result(states: dict[str, SchedulerState], errors: list[str], calls: dict[str, int]) -> QueryResult:
    worst: Source = max(states.values(), key=lambda s: _SOURCE_RANK[s.source]).source if states else "squeue"
    stale = any(s.stale for s in states.values())
    return QueryResult(states=states, source=worst, stale=stale, errors=tuple(errors), calls=calls)


def _final(job: JobRecord) -> SchedulerState:
    """The recorded end of a job that ended over :data:`FINAL_AFTER_S` ago (built without the frozen
    ``__init__``, as in :func:`parse_squeue`: thousands of finished jobs per ``status`` call)."""
    state = SchedulerState.__new__(SchedulerState)
    state.__dict__.update(
        _STATE_DEFAULTS,
        job_id=job.job_id,
        state=job.last_state,
        raw_state=job.last_state.value,
        source="final",
        reason=job.reason,
        node_list=job.node_list,
        exit_code=job.exit_code,
        start=None,
        elapsed=None,
    )
    return state


def refresh_states(registry: Registry, jobs: Sequence[JobRecord], timeout_s: float = 5.0) -> QueryResult:
    """Current state of ``jobs`` (one batched query per scheduler), written back to the registry
    (history grows only on change, plus node list / exit code / reason).

    This is what ``status``, ``logs -f`` and ``submit --wait`` poll.
    """
    from orchestrator.schedulers import get_scheduler

    by_scheduler: dict[str, list[JobRecord]] = {}
    states: dict[str, SchedulerState] = {}
    settled = time.time() - FINAL_AFTER_S
    for job in jobs:
        if job.last_state_at <= settled and job.last_state.is_terminal():
            states[job.job_id] = _final(job)
        else:
            by_scheduler.setdefault(job.scheduler, []).append(job)
    fallback = {j.job_id: j.last_state for j in jobs}
    errors: list[str] = []
    calls = {"squeue": 0, "sacct": 0}
    for name, group in by_scheduler.items():
        result = get_scheduler(name).query(group, timeout_s, fallback)
        states.update(result.states)
        errors.extend(result.errors)
        for key, count in result.calls.items():
            calls[key] = calls.get(key, 0) + count
    by_source: dict[str, dict[str, JobState]] = {}
    for job_id, st in states.items():
        if not st.stale and st.source != "final":  # the registry's own values: nothing new to record
            by_source.setdefault(st.source, {})[job_id] = st.state
    info = {
        j: (s.node_list, s.exit_code, s.reason)
        for j, s in states.items()
        if not s.stale and s.source != "final" and (s.node_list or s.exit_code or s.reason)
    }
    # One read of what the registry holds for both comparisons (1,000 ids: a query per 500 each).
    current = registry.scheduler_columns({j for batch in by_source.values() for j in batch}.union(info))
    for source, batch in by_source.items():
        registry.record_states(batch, source=source, current=current)
    registry.set_scheduler_info(info, current=current)
    return _result(states, errors, calls)
