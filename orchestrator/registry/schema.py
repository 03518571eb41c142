"""The registry file itself: its schema's history (migrations), bringing a file up to date, the
SQLite error cases opening must tell apart, and the records rows are read into.

Kept apart from :mod:`orchestrator.registry.store`, which answers the questions the commands ask, so the
whole history of the file format reads in one place.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from orchestrator.config.scheduler_kinds import SchedulerName
from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState

SchedulerKind = SchedulerName
#: Writers wait this long for the lock, then fail with one line naming the file. A burst of submits
#: holds it for milliseconds each; the 30 s this was made a stuck holder look like a hung command.
BUSY_TIMEOUT_MS = 10_000
_T = TypeVar("_T")

# Ordered migrations: index i (1-based) brings the schema from version i-1 to i. Never edit a
# released entry -- append a new one -- so every existing registry upgrades along the same path.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE jobs (
            job_id          TEXT PRIMARY KEY,
            name            TEXT NOT NULL,
            profile         TEXT NOT NULL,
            scheduler       TEXT NOT NULL CHECK (scheduler IN ('slurm', 'local')),
            strategy        TEXT NOT NULL,
            nodes           INTEGER NOT NULL CHECK (nodes >= 1),
            procs_per_node  INTEGER NOT NULL CHECK (procs_per_node >= 1),
            command         TEXT NOT NULL,
            run_dir         TEXT NOT NULL,
            submitted_at    REAL NOT NULL,
            last_state      TEXT NOT NULL,
            last_state_at   REAL NOT NULL,
            end_reason      TEXT,
            max_requeues    INTEGER NOT NULL DEFAULT 0
        )
        """,
        "CREATE INDEX jobs_submitted_at ON jobs (submitted_at)",
        "CREATE INDEX jobs_last_state ON jobs (last_state)",
        """
        CREATE TABLE state_history (
            id      INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id  TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            state   TEXT NOT NULL,
            at      REAL NOT NULL,
            source  TEXT NOT NULL
        )
        """,
        "CREATE INDEX state_history_job ON state_history (job_id, id)",
        """
        CREATE TABLE attempts (
            job_id                   TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            attempt                  INTEGER NOT NULL CHECK (attempt >= 0),
            scheduler_job_id         TEXT,
            started_from_checkpoint  TEXT,
            started_at               REAL,
            ended_at                 REAL,
            end_state                TEXT,
            PRIMARY KEY (job_id, attempt)
        )
        """,
        """
        CREATE TABLE checkpoints (
            job_id       TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
            step         INTEGER NOT NULL,
            path         TEXT NOT NULL,
            recorded_at  REAL NOT NULL
        )
        """,
        # Monotonic counters (local job ids) so an id is never handed out twice, even after deletes.
        "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    ),
    (
        # What the scheduler's accounting says about where and how the job ended (shown by `status`, kept after the
        # scheduler forgets the job).
        "ALTER TABLE jobs ADD COLUMN node_list TEXT",
        "ALTER TABLE jobs ADD COLUMN exit_code TEXT",
        "ALTER TABLE jobs ADD COLUMN reason TEXT",
    ),
    (
        # A run is one run directory and every job that trained in it: `resume` and `--auto-resume`
        # submit a new job into the same directory. Version 2 linked the new job through an attempt
        # row of the first one, which made attempts mean two things; a job now belongs to its run, and
        # run_seq (0 for the first job, counted under the write lock) orders the run's jobs.
        """
        CREATE TABLE runs (
            run_id      INTEGER PRIMARY KEY AUTOINCREMENT,
            run_dir     TEXT NOT NULL UNIQUE,
            created_at  REAL NOT NULL
        )
        """,
        "ALTER TABLE jobs ADD COLUMN run_id INTEGER REFERENCES runs (run_id)",
        "ALTER TABLE jobs ADD COLUMN run_seq INTEGER CHECK (run_seq >= 0)",
        "CREATE UNIQUE INDEX jobs_run ON jobs (run_id, run_seq)",
        # Existing jobs: one run per run directory, its jobs numbered in submission order.
        "INSERT INTO runs (run_dir, created_at) SELECT run_dir, MIN(submitted_at) FROM jobs "
        "GROUP BY run_dir ORDER BY MIN(submitted_at), run_dir",
        "UPDATE jobs SET run_id = (SELECT r.run_id FROM runs r WHERE r.run_dir = jobs.run_dir)",
        "UPDATE jobs SET run_seq = (SELECT COUNT(*) FROM jobs o WHERE o.run_id = jobs.run_id AND "
        "(o.submitted_at < jobs.submitted_at OR (o.submitted_at = jobs.submitted_at AND o.rowid < jobs.rowid)))",
        # The version-2 links (an attempt of one job naming a later job of the same run) are now said
        # by the run itself; the new job's own attempt row already holds its starting checkpoint.
        "DELETE FROM attempts WHERE scheduler_job_id != job_id AND EXISTS (SELECT 1 FROM jobs a "
        "JOIN jobs b ON b.run_id = a.run_id AND b.run_seq > a.run_seq "
        "WHERE a.job_id = attempts.job_id AND b.job_id = attempts.scheduler_job_id)",
        # Never written outside tests: the run directory's COMPLETE.json markers are the record.
        "DROP TABLE checkpoints",
    ),
    (
        # Two-phase submission: the intent (run directory, attempt, the token the scheduler job
        # carries) is recorded before sbatch runs, and closed once the job is in `jobs`. A command
        # killed in between leaves a 'pending' row, which the next command reconciles: it adopts the
        # job carrying the token, or cleans up what the submission had made.
        """
        CREATE TABLE submissions (
            token         TEXT PRIMARY KEY,
            run_dir       TEXT NOT NULL,
            attempt_base  INTEGER NOT NULL,
            new_run_dir   INTEGER NOT NULL,
            scheduler     TEXT NOT NULL,
            job           TEXT NOT NULL,
            pid           INTEGER NOT NULL,
            host          TEXT NOT NULL,
            created_at    REAL NOT NULL,
            state         TEXT NOT NULL,
            job_id        TEXT,
            note          TEXT,
            updated_at    REAL NOT NULL
        )
        """,
        "CREATE INDEX submissions_state ON submissions (state)",
    ),
    (
        # Sweeps (issue 15): one grid of runs submitted together (a Slurm job array). Each task is an
        # ordinary job with its own run directory; sweep_tasks says which job is which grid point.
        """
        CREATE TABLE sweeps (
            sweep_id      TEXT PRIMARY KEY,
            name          TEXT NOT NULL,
            scheduler     TEXT NOT NULL,
            sweep_dir     TEXT NOT NULL,
            grid          TEXT NOT NULL,
            max_parallel  INTEGER NOT NULL CHECK (max_parallel >= 1),
            created_at    REAL NOT NULL
        )
        """,
        """
        CREATE TABLE sweep_tasks (
            sweep_id  TEXT NOT NULL REFERENCES sweeps (sweep_id) ON DELETE CASCADE,
            task      INTEGER NOT NULL CHECK (task >= 0),
            job_id    TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            params    TEXT NOT NULL,
            PRIMARY KEY (sweep_id, task)
        )
        """,
        "CREATE INDEX sweep_tasks_job ON sweep_tasks (job_id)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)

JOB_COLUMNS = (
    "job_id, name, profile, scheduler, strategy, nodes, procs_per_node, command, run_dir, "
    "submitted_at, last_state, last_state_at, end_reason, max_requeues, node_list, exit_code, reason"
)


@dataclass(frozen=True)
class JobRecord:
    """One row of ``jobs``; ``command`` is the argv list, ``run_dir`` an absolute path."""

    job_id: str
    name: str
    profile: str
    scheduler: SchedulerKind
    strategy: str
    nodes: int
    procs_per_node: int
    command: list[str]
    run_dir: Path
    submitted_at: float
    last_state: JobState
    last_state_at: float
    end_reason: str | None
    max_requeues: int
    node_list: str | None = None
    exit_code: str | None = None
    reason: str | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (used by ``list --json`` / ``status --json``)."""
        return {
            "job_id": self.job_id,
            "name": self.name,
            "profile": self.profile,
            "scheduler": self.scheduler,
            "strategy": self.strategy,
            "nodes": self.nodes,
            "procs_per_node": self.procs_per_node,
            "command": list(self.command),
            "run_dir": str(self.run_dir),
            "submitted_at": self.submitted_at,
            "last_state": self.last_state.value,
            "last_state_at": self.last_state_at,
            "end_reason": self.end_reason,
            "max_requeues": self.max_requeues,
            "node_list": self.node_list,
            "exit_code": self.exit_code,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class StateChange:
    """One row of ``state_history``: the job entered ``state`` at ``at``, as seen by ``source``."""

    job_id: str
    state: JobState
    at: float
    source: str


@dataclass(frozen=True)
class Attempt:
    """One start of one job id: its submission, then each Slurm requeue of the same id.

    A new job submitted into the same run directory (``resume``, ``--auto-resume``) is not an
    attempt of the old one: it is the next job of their :class:`RunRecord`.
    """

    job_id: str
    attempt: int
    scheduler_job_id: str | None
    started_from_checkpoint: str | None
    started_at: float | None
    ended_at: float | None
    end_state: JobState | None


@dataclass(frozen=True)
class RunRecord:
    """One run directory and the jobs that trained in it, in submission order.

    The first job is the id users know the run by; the last is the one whose state is the run's.
    """

    run_id: int
    run_dir: Path
    created_at: float
    job_ids: tuple[str, ...]

    @property
    def root_job_id(self) -> str:
        return self.job_ids[0]

    @property
    def newest_job_id(self) -> str:
        return self.job_ids[-1]


def is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """Tell "this file is not a usable database" apart from "locked"/"read-only" errors."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    msg = str(exc).lower()
    return "not a database" in msg or "malformed" in msg


def is_locked(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def retry_when_locked(step: Callable[[], _T], budget_s: float = BUSY_TIMEOUT_MS / 1000) -> _T:
    """Run ``step`` again (bounded exponential backoff with jitter) while SQLite says "locked".

    The busy timeout does not cover everything ``open`` does: switching a new file to WAL while
    another process holds a RESERVED lock on it (a second first-time ``submit`` creating the
    schema) fails at once with "database is locked", whatever busy_timeout says, and in rollback
    mode two writers can meet in a lock upgrade SQLite refuses to wait on (deadlock avoidance).
    Both steps are safe to repeat: the journal-mode switch is idempotent, and a failed migration
    rolled back and re-reads the schema version under its lock.
    """
    deadline = time.monotonic() + budget_s
    delay = 0.005
    while True:
        try:
            return step()
        except sqlite3.OperationalError as exc:
            if not is_locked(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.25)


def schema_version(conn: sqlite3.Connection) -> int:
    """Version recorded in the file, 0 for a new/empty file (read without taking a write lock)."""
    has_table = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if not has_table:
        return 0
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Apply pending migrations in one IMMEDIATE transaction, so concurrent openers serialise and a
    failure leaves the file at its old version."""
    current = schema_version(conn)
    if current == SCHEMA_VERSION:
        return
    if current > SCHEMA_VERSION:
        raise UserError(
            f"registry {path} has schema version {current}, newer than this orchestrator "
            f"supports ({SCHEMA_VERSION}); upgrade orchestrator"
        )
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        current = schema_version(conn)  # again, under the lock: another opener may have migrated
        for version in range(current + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version - 1]:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


_STATES = {s.value: s for s in JobState}


class BadRow(UserError):
    """A jobs row that cannot be read (edited by hand, or by a tool that skipped the checks)."""


#: Columns ``job_from_row`` converts, with what each must be: the wording of a bad row's error.
_ROW_CHECKS: tuple[tuple[int, str, str], ...] = (
    (0, "job_id", "non-empty text"),
    (1, "name", "non-empty text"),
    (2, "profile", "non-empty text"),
    (3, "scheduler", "non-empty text"),
    (4, "strategy", "non-empty text"),
    (5, "nodes", "an integer"),
    (6, "procs_per_node", "an integer"),
    (8, "run_dir", "non-empty text"),
    (9, "submitted_at", "a number"),
    (11, "last_state_at", "a number"),
    (13, "max_requeues", "an integer"),
)


def _bad_row(row: Sequence[Any]) -> BadRow:
    """Which column of ``row`` is unreadable, as one line naming the row (the slow path of a failure)."""
    for index, column, kind in _ROW_CHECKS:
        value: Any = row[index] if index < len(row) else None
        try:
            if kind == "an integer":
                ok = not isinstance(value, bool) and int(value) == float(value)
            elif kind == "a number":
                ok = float(value) == float(value)  # NaN is not a time
            else:
                ok = isinstance(value, str) and value != ""
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            return BadRow(f"registry row {row[0]!r}: {column}: expected {kind}, got {value!r}")
    return BadRow(f"registry row {row[0] if row else None!r}: unreadable")


def job_from_row(row: Sequence[Any]) -> JobRecord:
    """The row's record; :class:`BadRow` (naming the row and column) when a value cannot be one."""
    try:
        return _job_from_row(row)
    except (TypeError, ValueError, IndexError, OverflowError):
        raise _bad_row(row) from None


def _job_from_row(row: Sequence[Any]) -> JobRecord:
    try:
        command = json.loads(row[7])
    except (TypeError, ValueError):
        command = [str(row[7])]
    state = _STATES.get(row[10], JobState.UNKNOWN)  # a dict lookup: Enum() costs ~1 us x 1,000 rows
    # Not JobRecord(...): a frozen dataclass's __init__ sets each of its 17 fields through
    # object.__setattr__, the largest cost of reading 1,000 rows for `status`. Same fields, same values.
    record = JobRecord.__new__(JobRecord)
    record.__dict__.update(
        job_id=row[0],
        name=row[1],
        profile=row[2],
        scheduler=row[3],
        strategy=row[4],
        nodes=int(row[5]),
        procs_per_node=int(row[6]),
        command=[str(c) for c in command] if isinstance(command, list) else [str(command)],
        run_dir=Path(row[8]),
        submitted_at=float(row[9]),
        last_state=state,
        last_state_at=float(row[11]),
        end_reason=row[12],
        max_requeues=int(row[13]),
        node_list=row[14],
        exit_code=row[15],
        reason=row[16],
    )
    return record
