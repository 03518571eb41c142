"""A job's logs: printed once (all of them, or the last K lines per file) or followed to its end.

Following prints the last K lines (default 10) and keeps printing new lines, across requeues (new
``attempt_<A>`` folders) until the scheduler reports a terminal state, and returns that state. A
deleted run directory is a run failure, an attempt that never ran a user error.

:func:`follow_job_until_done` is the reusable core (``logs -f``, and ``submit --wait`` may call it).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import LOGS_DIR
from orchestrator.registry.store import JobRecord, Registry
from orchestrator.rundir.log_follow import LogFollower, LogLine, leaves, refusal
from orchestrator.runner.refresh import refresh_states

DEFAULT_FOLLOW_TAIL = 10
#: Lines shown from each of the scheduler's own log files when no node has logged.
DEFAULT_SCHEDULER_TAIL = 20


def print_scheduler_logs(job: JobRecord, tail: int, out: TextIO, err: TextIO | None = None) -> None:
    """A job that ended before any node started says why only in the scheduler's files (a set-up
    line, a missing interpreter, a refused allocation): show their last lines. One that is a symlink
    out of the run directory is not read (a note on ``err``)."""
    from orchestrator.rundir.summary import iter_lines_reversed
    from orchestrator.schedulers import get_scheduler

    for path in get_scheduler(job.scheduler).log_files(Path(job.run_dir), job.job_id):
        if leaves(path, job.run_dir):
            print(refusal(path), file=sys.stderr if err is None else err)
            continue
        try:
            if path.stat().st_size == 0:
                continue
            lines = [ln.decode(errors="replace") for ln in iter_lines_reversed(path, 1 << 20)]
        except OSError:
            continue
        shown = lines[:tail][::-1]
        if shown:
            out.write(f"==> {path} <==\n")
            out.write("\n".join(shown) + "\n")


def _note_refused(follower: LogFollower, err: TextIO, said: set[Path]) -> None:
    """One line on ``err`` for each path the follower would not read (a symlink out of the run)."""
    for path in follower.refused:
        if path not in said:
            said.add(path)
            print(refusal(path), file=err, flush=True)


def _printer(out: TextIO, prefixed: bool) -> Callable[[LogLine], None]:
    """Lines from several files get an ``[aA nN]`` prefix so interleaved output stays readable."""

    def emit(line: LogLine) -> None:
        if prefixed:
            out.write(f"[a{line.attempt} n{line.node}] {line.text}\n")
        else:
            out.write(line.text + "\n")

    return emit


def _framed_printer(out: TextIO, prefixed: bool) -> Callable[[LogLine], None]:
    """``logs -f --framed``: each line as the JSON record a remote reader resumes from (:class:`Resume`)."""
    shown = io.StringIO()
    render = _printer(shown, prefixed)

    def emit(line: LogLine) -> None:
        shown.seek(0)
        shown.truncate()
        render(line)
        record = {"t": shown.getvalue(), "k": f"{line.attempt}.{line.node}", "e": line.end}
        out.write(json.dumps(record, ensure_ascii=False) + "\n")

    return emit


class Resume:
    """Where a ``logs -f`` reader is: the first attempt it follows and, per file, the offset it has
    printed up to. ``logs -f --framed`` writes the starting point (``{"m": A, "c": {"A.N": [inode,
    offset]}}``), then one record per line (``{"t": text, "k": "A.N", "e": end}``); a reader that
    loses the stream starts a new one with ``--resume-from`` this state: nothing twice, nothing lost,
    however the files' lines interleaved (``orchestrator.remote`` over a dropped SSH connection)."""

    def __init__(self, state: dict[str, object] | None = None) -> None:
        state = state or {}
        self.min_attempt = int(state.get("m", -1))  # type: ignore[call-overload]
        self.cursors: dict[str, list[int]] = dict(state.get("c", {}))  # type: ignore[call-overload]

    def take(self, record: dict[str, object]) -> str | None:
        """Fold one framed record in; the text to print, if it is a line."""
        if "m" in record:
            self.min_attempt = int(record["m"])  # type: ignore[call-overload]
            self.cursors.update(record.get("c", {}))  # type: ignore[call-overload]
            return None
        key, end = str(record["k"]), int(record["e"])  # type: ignore[call-overload]
        if end >= 0:
            inode = self.cursors.get(key, [-1, 0])[0]
            self.cursors[key] = [inode, end]
        return str(record["t"])

    def started(self) -> bool:
        return self.min_attempt >= 0

    def to_json(self) -> str:
        return json.dumps({"m": self.min_attempt, "c": self.cursors}, separators=(",", ":"))

    def offsets(self) -> dict[tuple[int, int], tuple[int, int]]:
        out = {}
        for key, (inode, offset) in self.cursors.items():
            a, n = key.split(".")
            out[(int(a), int(n))] = (int(inode), int(offset))
        return out


def make_follower(
    job: JobRecord, *, node: int | None = None, rank: int | None = None, attempt: int | None = None
) -> LogFollower:
    """Validate the selection against the job's shape (user errors, exit 2) and build a follower."""
    check_shape(job, node=node, rank=rank, attempt=attempt)
    try:
        return LogFollower(
            job.run_dir, attempt=attempt, node=node, rank=rank, procs_per_node=job.procs_per_node
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def check_shape(job: JobRecord, *, node: int | None, rank: int | None, attempt: int | None) -> None:
    """Node, rank and attempt numbers the job cannot have (user errors, exit 2)."""
    if node is not None and not 0 <= node < job.nodes:
        raise UserError(f"--node {node}: job {job.job_id} has nodes 0..{job.nodes - 1}")
    if rank is not None and not 0 <= rank < job.world_size:
        raise UserError(f"--rank {rank}: job {job.job_id} has ranks 0..{job.world_size - 1}")
    if attempt is not None and attempt < 0:
        raise UserError(f"--attempt {attempt}: attempts are numbered from 0")


def follow_job_until_done(
    job_id: str,
    *,
    registry: Registry | None = None,
    out: TextIO | None = None,
    node: int | None = None,
    rank: int | None = None,
    attempt: int | None = None,
    tail: int | None = DEFAULT_FOLLOW_TAIL,
    interval: float = 0.25,
    max_interval: float = 2.0,
    state_every_s: float = 5.0,
    query_timeout_s: float = 5.0,
    framed: bool = False,
    resume_from: Resume | None = None,
    err: TextIO | None = None,
) -> JobState:
    """Print the job's logs as they grow until it reaches a terminal state; return that state.

    The state is refreshed (one scheduler query, recorded in the registry) at most every
    ``state_every_s`` seconds, and only when the logs are quiet. A stale answer (scheduler
    unreachable) never ends the follow on its own unless the registry already says terminal.
    """
    own = registry is None
    reg = Registry.open() if registry is None else registry
    stream = sys.stdout if out is None else out
    notes = sys.stderr if err is None else err
    said: set[Path] = set()
    try:
        job = reg.get(job_id)
        follower = make_follower(job, node=node, rank=rank, attempt=attempt)
        prefixed = node is None and rank is None and job.nodes > 1
        emit = (_framed_printer if framed else _printer)(stream, prefixed)
        final: list[JobState] = [job.last_state]

        def is_done() -> bool:
            # The run's state, not this job's: a run that went on in a successor job (a requeue as a
            # new job, an auto-resume) writes its next attempts into the same folder, followed here.
            newest = reg.successors([job_id]).get(job_id, job_id)
            current = reg.get(newest)
            result = refresh_states(reg, [current], timeout_s=query_timeout_s)
            st = result.states.get(newest)
            state = st.state if st is not None else current.last_state
            final[0] = state
            return state.is_terminal()

        shown = []
        if resume_from is not None and resume_from.started():
            follower.start_at(resume_from.min_attempt, resume_from.offsets())
        elif tail is not None:
            shown = follower.tail(tail)
        if framed:  # where this stream starts, before its first line
            start = {f"{a}.{n}": list(at) for (a, n), at in follower.window_starts.items()}
            if resume_from is not None and resume_from.started():
                start = resume_from.cursors
            stream.write(json.dumps({"m": follower.min_attempt, "c": start}) + "\n")
        for line in shown:
            emit(line)
        stream.flush()
        _note_refused(follower, notes, said)
        for line in follower.follow(
            is_done, interval=interval, max_interval=max_interval, done_check_s=state_every_s
        ):
            emit(line)
            stream.flush()
            if len(follower.refused) > len(said):
                _note_refused(follower, notes, said)
        stream.flush()
        _note_refused(follower, notes, said)
        return final[0]
    finally:
        if own:
            reg.close()


def check_selection(job: JobRecord, attempt: int | None) -> None:
    """A run directory that is gone, or an attempt that never ran, is an error (not empty output)."""
    from orchestrator.contract.run_dir import attempt_dirs

    run_dir = Path(job.run_dir)
    if not run_dir.is_dir():
        raise RunFailure(f"job {job.job_id}: its run directory {run_dir} no longer exists")
    if attempt is not None and attempt >= 0:
        existing = [a for a, _ in attempt_dirs(run_dir)]
        if attempt not in existing:
            have = ", ".join(map(str, existing)) if existing else "none yet"
            raise UserError(
                f"--attempt {attempt}: job {job.job_id} has no attempt {attempt} (attempts: {have})"
            )


def show_logs(
    registry: Registry,
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
    framed: bool = False,
    resume_from: Resume | None = None,
) -> JobState | None:
    """``logs``: print the selected logs to ``out`` (notes to ``err``). ``follow``: until the job
    ends, and its final state; otherwise what is there now, and None. ``framed``/``resume_from``
    (with ``follow``): the resumable stream of :class:`Resume`."""
    stdout = sys.stdout if out is None else out
    stderr = sys.stderr if err is None else err
    job = registry.get(job_id)
    check_shape(job, node=node, rank=rank, attempt=attempt)
    check_selection(job, attempt)
    if follow:
        return follow_job_until_done(
            job.job_id,
            registry=registry,
            out=stdout,
            node=node,
            rank=rank,
            attempt=attempt,
            tail=DEFAULT_FOLLOW_TAIL if tail is None else tail,
            interval=interval,
            max_interval=max(2.0, interval),
            framed=framed,
            resume_from=resume_from,
            err=stderr,
        )
    follower = make_follower(job, node=node, rank=rank, attempt=attempt)
    sources = follower.sources()
    said: set[Path] = set()
    _note_refused(follower, stderr, said)
    if not sources:
        where = Path(job.run_dir) / LOGS_DIR
        print(f"no node logs for job {job.job_id} (looked in {where}; state {job.last_state})", file=stderr)
        print_scheduler_logs(job, DEFAULT_SCHEDULER_TAIL if tail is None else tail, stdout, stderr)
        return None
    emit = _printer(stdout, prefixed=len(sources) > 1)
    if tail is not None:
        for line in follower.tail(tail):
            emit(line)
    else:
        for line in follower.stream(final=True):
            emit(line)
    stdout.flush()
    _note_refused(follower, stderr, said)
    note_error_elsewhere(job, {str(path) for _, _, path in sources}, stderr)
    return None


def note_error_elsewhere(job: JobRecord, shown: set[str], err: TextIO) -> None:
    """A failed job whose error is not in the logs just shown (it reached only the scheduler's own
    files: a bad ``network_interface``, a full disk before the launch) gets a line saying where it is."""
    from orchestrator.runner.failure_reasons import EXPLAINED_STATES, explain_job

    if job.last_state.value not in EXPLAINED_STATES:
        return
    why = explain_job(job)
    if why is None or not why.source or why.source in shown or not Path(why.source).is_file():
        return
    first = why.lines[0] if why.lines else ""
    print(
        f"note: job {job.job_id} failed with an error that is not in these logs, in {why.source}: {first}",
        file=err,
    )
