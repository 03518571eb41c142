"""The job registry: one SQLite file that remembers every job this user submitted.

Why SQLite and not a JSON file per job: ``status`` over 1,000 jobs must be one query, several
``submit`` processes may write at the same time (a sweep launched from a shell loop), and a
half-written JSON file after Ctrl-C would lose jobs. SQLite in WAL mode gives atomic commits,
concurrent readers with one writer, and ``busy_timeout`` makes writers queue instead of failing.

Location: ``$ORCHESTRATOR_HOME/registry.db`` (default ``~/.orchestrator``). The directory is
created 0700 and the file 0600 because run directories and commands may reveal private paths.

The registry never deletes or rewrites a file it cannot read: a corrupt file is reported as a
:class:`~orchestrator.errors.UserError` naming the path, and the user decides what to do with it.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from orchestrator.errors import UserError
from orchestrator.job_states import JobState, parse_state

REGISTRY_FILENAME = "registry.db"
HOME_ENV = "ORCHESTRATOR_HOME"
#: Writers wait this long for the lock before giving up. Long enough for a burst of submits.
BUSY_TIMEOUT_MS = 30_000

SchedulerKind = Literal["slurm", "local"]
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
        # What sacct says about where and how the job ended (shown by `status`, kept after the
        # scheduler forgets the job).
        "ALTER TABLE jobs ADD COLUMN node_list TEXT",
        "ALTER TABLE jobs ADD COLUMN exit_code TEXT",
        "ALTER TABLE jobs ADD COLUMN reason TEXT",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)

_JOB_COLUMNS = (
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
    """One run of a job: attempt 0 is the first submission, each requeue/resubmit adds one."""

    job_id: str
    attempt: int
    scheduler_job_id: str | None
    started_from_checkpoint: str | None
    started_at: float | None
    ended_at: float | None
    end_state: JobState | None


@dataclass(frozen=True)
class CheckpointRecord:
    """The last checkpoint known to be complete (its COMPLETE.json marker was verified)."""

    job_id: str
    step: int
    path: str
    recorded_at: float


def default_home() -> Path:
    """``$ORCHESTRATOR_HOME`` if set, else ``~/.orchestrator``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".orchestrator"


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """Tell "this file is not a usable database" apart from "locked"/"read-only" errors."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    msg = str(exc).lower()
    return "not a database" in msg or "malformed" in msg


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def _retry_when_locked(step: Callable[[], _T], budget_s: float = BUSY_TIMEOUT_MS / 1000) -> _T:
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
            if not _is_locked(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.25)


class Registry:
    """Handle on the registry database. Cheap to open; use as a context manager or call close()."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path

    # ------------------------------------------------------------------ opening / migrations
    @classmethod
    def open(cls, home: Path | None = None) -> Registry:
        """Open (creating if needed) ``<home>/registry.db`` and bring its schema up to date."""
        home = Path(home).expanduser() if home is not None else default_home()
        path = home / REGISTRY_FILENAME
        try:
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not path.exists():
                # Create the file ourselves so it is 0600 from the first byte (SQLite would use the
                # umask), and SQLite gives its -wal/-shm files the same mode as the database.
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
                os.close(fd)
        except OSError as exc:
            raise UserError(f"cannot create registry {path}: {exc.strerror or exc}") from None
        if path.is_dir():
            raise UserError(f"registry {path} is a directory, not a database file")
        try:
            conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise UserError(f"cannot open registry {path}: {exc}") from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = _retry_when_locked(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
            if mode is None or str(mode[0]).lower() != "wal":
                # A network file system without shared memory refuses WAL; rollback mode still
                # works (with less concurrency), so carry on rather than refuse to run.
                pass
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            reg = cls(conn, path)
            _retry_when_locked(reg._migrate)
        except sqlite3.DatabaseError as exc:
            conn.close()
            if _is_corruption(exc):
                raise UserError(
                    f"registry {path} is not a readable SQLite database ({exc}); "
                    "it was left untouched -- move it aside to start a new registry"
                ) from None
            raise UserError(f"cannot use registry {path}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        return reg

    def _migrate(self) -> None:
        """Apply pending migrations in one IMMEDIATE transaction (so concurrent openers serialise)."""
        conn = self._conn
        current = self._schema_version()
        if current == SCHEMA_VERSION:
            return
        if current > SCHEMA_VERSION:
            raise UserError(
                f"registry {self.path} has schema version {current}, newer than this orchestrator "
                f"supports ({SCHEMA_VERSION}); upgrade orchestrator"
            )
        with self._write():
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
            current = int(row[0]) if row and row[0] is not None else 0
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[version - 1]:
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def _schema_version(self) -> int:
        """Version recorded in the file, 0 for a new/empty file (read without taking a write lock)."""
        has_table = self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        ).fetchone()
        if not has_table:
            return 0
        row = self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    @property
    def schema_version(self) -> int:
        return self._schema_version()

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: take the write lock up front so read-then-write never deadlocks."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")

    # ------------------------------------------------------------------ jobs
    def allocate_local_id(self) -> str:
        """Next ``local-<n>`` id; atomic across processes and never reused."""
        with self._write() as conn:
            conn.execute("INSERT OR IGNORE INTO counters (name, value) VALUES ('local_job', 0)")
            conn.execute("UPDATE counters SET value = value + 1 WHERE name = 'local_job'")
            row = conn.execute("SELECT value FROM counters WHERE name = 'local_job'").fetchone()
        return f"local-{int(row[0])}"

    def add_job(
        self,
        *,
        job_id: str,
        name: str,
        profile: str,
        scheduler: SchedulerKind,
        strategy: str,
        nodes: int,
        procs_per_node: int,
        command: Sequence[str],
        run_dir: Path | str,
        max_requeues: int = 0,
        submitted_at: float | None = None,
        state: JobState = JobState.PENDING,
        source: str = "submit",
    ) -> JobRecord:
        """Insert a new job and its first state-history entry in one transaction.

        A duplicate id is a UserError: Slurm ids restart at 1 after a cluster state wipe, and
        silently overwriting an old job's row would point ``status`` at the wrong run directory.
        """
        if scheduler not in ("slurm", "local"):
            raise UserError(f"scheduler must be 'slurm' or 'local', not {scheduler!r}")
        now = time.time() if submitted_at is None else submitted_at
        run_dir_s = str(Path(run_dir).expanduser().absolute())
        try:
            with self._write() as conn:
                conn.execute(
                    f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        job_id,
                        name,
                        profile,
                        scheduler,
                        strategy,
                        int(nodes),
                        int(procs_per_node),
                        json.dumps(list(command)),
                        run_dir_s,
                        now,
                        state.value,
                        now,
                        None,
                        int(max_requeues),
                        None,
                        None,
                        None,
                    ),
                )
                conn.execute(
                    "INSERT INTO state_history (job_id, state, at, source) VALUES (?,?,?,?)",
                    (job_id, state.value, now, source),
                )
        except sqlite3.IntegrityError as exc:
            if "UNIQUE" in str(exc) or "PRIMARY KEY" in str(exc):
                raise UserError(f"job id {job_id!r} is already in the registry {self.path}") from None
            raise UserError(f"invalid job record for {job_id!r}: {exc}") from None
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord:
        """The job's row; an unknown id is a user error that points at ``orchestrator list``."""
        row = self._conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)")
        return _job_from_row(row)

    def get_many(self, job_ids: Iterable[str]) -> list[JobRecord]:
        """Several jobs in the order asked; raises UserError on the first unknown id."""
        return [self.get(j) for j in job_ids]

    def list_jobs(
        self,
        state: JobState | str | Iterable[JobState | str] | None = None,
        since: float | None = None,
    ) -> list[JobRecord]:
        """Jobs, oldest submission first, optionally only in the given state(s) / submitted since."""
        clauses: list[str] = []
        params: list[Any] = []
        if state is not None:
            states = [state] if isinstance(state, (str, JobState)) else list(state)
            values = [s.value if isinstance(s, JobState) else parse_state(s).value for s in states]
            clauses.append(f"last_state IN ({','.join('?' * len(values))})")
            params.extend(values)
        if since is not None:
            clauses.append("submitted_at >= ?")
            params.append(float(since))
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs {where} ORDER BY submitted_at, job_id", params
        ).fetchall()
        return [_job_from_row(r) for r in rows]

    def active_and_recent(self, recent_s: float = 24 * 3600.0, now: float | None = None) -> list[JobRecord]:
        """Non-terminal jobs plus any job submitted or changed state within ``recent_s`` seconds."""
        now = time.time() if now is None else now
        terminal = [s.value for s in JobState if s.is_terminal()]
        rows = self._conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs WHERE last_state NOT IN ({','.join('?' * len(terminal))}) "
            "OR last_state_at >= ? OR submitted_at >= ? ORDER BY submitted_at, job_id",
            (*terminal, now - recent_s, now - recent_s),
        ).fetchall()
        return [_job_from_row(r) for r in rows]

    # ------------------------------------------------------------------ states
    def record_state(self, job_id: str, state: JobState, source: str, at: float | None = None) -> bool:
        """Set the job's current state; history gets a row only when the state actually changes.

        Returns True if it changed. Polling ``status`` every few seconds must not grow the history
        table by one row per poll.
        """
        changed = self.record_states({job_id: state}, source, at=at)
        if not changed and not self._exists(job_id):
            raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)")
        return bool(changed)

    def record_states(
        self, states: Mapping[str, JobState], source: str, at: float | None = None
    ) -> list[str]:
        """Batch form of :meth:`record_state` in one transaction (``status`` over 1,000 jobs).

        Unknown ids are ignored here; returns the ids whose state changed.
        """
        if not states:
            return []
        # Read first, write only what differs: a poll where nothing changed (the usual case) then
        # takes no write lock and writes nothing, instead of 1,000 no-op UPDATEs under the lock.
        current = self._columns(states, "last_state")
        todo = {j: s for j, s in states.items() if j in current and current[j][0] != s.value}
        if not todo:
            return []
        now = time.time() if at is None else at
        changed: list[str] = []
        with self._write() as conn:
            for job_id, state in todo.items():
                cur = conn.execute(
                    "UPDATE jobs SET last_state = ?, last_state_at = ? WHERE job_id = ? AND last_state != ?",
                    (state.value, now, job_id, state.value),
                )
                if cur.rowcount:
                    conn.execute(
                        "INSERT INTO state_history (job_id, state, at, source) VALUES (?,?,?,?)",
                        (job_id, state.value, now, source),
                    )
                    changed.append(job_id)
        return changed

    def _columns(self, job_ids: Iterable[str], columns: str) -> dict[str, tuple[Any, ...]]:
        """``{job_id: (columns...)}`` for the ids that exist, in a few ``IN`` queries."""
        ids = list(job_ids)
        out: dict[str, tuple[Any, ...]] = {}
        for i in range(0, len(ids), 500):  # under SQLite's bound-parameter limit on any version
            chunk = ids[i : i + 500]
            rows = self._conn.execute(
                f"SELECT job_id, {columns} FROM jobs WHERE job_id IN ({','.join('?' * len(chunk))})", chunk
            ).fetchall()
            out.update((r[0], tuple(r[1:])) for r in rows)
        return out

    def _exists(self, job_id: str) -> bool:
        return self._conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone() is not None

    def history(self, job_id: str) -> list[StateChange]:
        """State changes of one job, oldest first."""
        rows = self._conn.execute(
            "SELECT job_id, state, at, source FROM state_history WHERE job_id = ? ORDER BY id", (job_id,)
        ).fetchall()
        return [StateChange(r[0], JobState(r[1]), float(r[2]), r[3]) for r in rows]

    def set_end_reason(self, job_id: str, reason: str | None) -> None:
        """Why the job ended (or was asked to), in words; shown by ``list``/``status --json``."""
        with self._write() as conn:
            cur = conn.execute("UPDATE jobs SET end_reason = ? WHERE job_id = ?", (reason, job_id))
        if cur.rowcount == 0:
            raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)")

    def set_scheduler_info(
        self,
        info: Mapping[str, tuple[str | None, str | None, str | None]],
    ) -> None:
        """Store ``{job_id: (node_list, exit_code, reason)}`` from squeue/sacct, keeping old values
        where the scheduler now reports nothing (sacct forgets, the registry should not)."""
        if not info:
            return
        current = self._columns(info, "node_list, exit_code, reason")
        todo = {
            j: v
            for j, v in info.items()
            if j in current and tuple(new or old for new, old in zip(v, current[j], strict=True)) != current[j]
        }
        if not todo:
            return  # the usual poll: the scheduler says what the registry already holds
        with self._write() as conn:
            for job_id, (node_list, exit_code, reason) in todo.items():
                conn.execute(
                    "UPDATE jobs SET node_list = COALESCE(?, node_list), exit_code = COALESCE(?, exit_code), "
                    "reason = COALESCE(?, reason) WHERE job_id = ?",
                    (node_list or None, exit_code or None, reason or None, job_id),
                )

    # ------------------------------------------------------------------ attempts
    def add_attempt(
        self,
        job_id: str,
        *,
        attempt: int | None = None,
        scheduler_job_id: str | None = None,
        started_from_checkpoint: str | None = None,
        started_at: float | None = None,
    ) -> Attempt:
        """Record a new attempt; ``attempt=None`` takes the next number atomically."""
        now = time.time() if started_at is None else started_at
        try:
            with self._write() as conn:
                if attempt is None:
                    row = conn.execute(
                        "SELECT COALESCE(MAX(attempt) + 1, 0) FROM attempts WHERE job_id = ?", (job_id,)
                    ).fetchone()
                    attempt = int(row[0])
                conn.execute(
                    "INSERT INTO attempts (job_id, attempt, scheduler_job_id, started_from_checkpoint, "
                    "started_at) VALUES (?,?,?,?,?)",
                    (job_id, attempt, scheduler_job_id, started_from_checkpoint, now),
                )
        except sqlite3.IntegrityError as exc:
            if not self._exists(job_id):
                raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)") from None
            raise UserError(f"attempt {attempt} of job {job_id!r} already recorded ({exc})") from None
        return Attempt(job_id, attempt, scheduler_job_id, started_from_checkpoint, now, None, None)

    def end_attempt(
        self, job_id: str, attempt: int, end_state: JobState, ended_at: float | None = None
    ) -> None:
        """Close an attempt with its final scheduler state."""
        now = time.time() if ended_at is None else ended_at
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE attempts SET ended_at = ?, end_state = ? WHERE job_id = ? AND attempt = ?",
                (now, end_state.value, job_id, attempt),
            )
        if cur.rowcount == 0:
            raise UserError(f"job {job_id!r} has no attempt {attempt}")

    def attempts(self, job_id: str) -> list[Attempt]:
        """All attempts of a job, in order."""
        rows = self._conn.execute(
            "SELECT job_id, attempt, scheduler_job_id, started_from_checkpoint, started_at, ended_at, "
            "end_state FROM attempts WHERE job_id = ? ORDER BY attempt",
            (job_id,),
        ).fetchall()
        return [
            Attempt(r[0], int(r[1]), r[2], r[3], r[4], r[5], JobState(r[6]) if r[6] is not None else None)
            for r in rows
        ]

    def attempt_counts(self, job_ids: Iterable[str] | None = None) -> dict[str, int]:
        """``{job_id: number of attempts}`` in one query (``status`` needs it for every row)."""
        rows = self._conn.execute("SELECT job_id, COUNT(*) FROM attempts GROUP BY job_id").fetchall()
        counts = {r[0]: int(r[1]) for r in rows}
        if job_ids is None:
            return counts
        return {j: counts.get(j, 0) for j in job_ids}

    def successors(self, job_ids: Iterable[str]) -> dict[str, str]:
        """``{job_id: the job its run continues in}`` for jobs whose run went on as a new job
        (``resume``, ``--auto-resume``): the newest attempt that names another registered job.
        Followed transitively, so a job resumed twice maps to the last one; ids with no successor
        are absent."""
        direct: dict[str, str] = {}
        frontier = list(dict.fromkeys(job_ids))
        for _ in range(64):  # a chain longer than this is not a real run's history
            todo = [j for j in frontier if j not in direct]
            if not todo:
                break
            found: dict[str, str] = {}
            for i in range(0, len(todo), 500):
                chunk = todo[i : i + 500]
                rows = self._conn.execute(
                    "SELECT a.job_id, a.scheduler_job_id FROM attempts a JOIN jobs j ON j.job_id = a.scheduler_job_id "
                    f"WHERE a.job_id IN ({','.join('?' * len(chunk))}) AND a.scheduler_job_id != a.job_id "
                    "ORDER BY a.job_id, a.attempt",
                    chunk,
                ).fetchall()
                found.update((r[0], r[1]) for r in rows)  # ordered by attempt: the newest wins
            direct.update(found)
            frontier = list(found.values())
        out: dict[str, str] = {}
        for start in direct:
            seen = {start}
            last = direct[start]
            while last in direct and direct[last] not in seen:
                seen.add(last)
                last = direct[last]
            if last != start:
                out[start] = last
        return {j: out[j] for j in dict.fromkeys(job_ids) if j in out}

    # ------------------------------------------------------------------ checkpoints
    def record_checkpoint(self, job_id: str, step: int, path: Path | str, at: float | None = None) -> None:
        """Remember the last *complete* checkpoint; an older step never replaces a newer one."""
        now = time.time() if at is None else at
        try:
            with self._write() as conn:
                conn.execute(
                    "INSERT INTO checkpoints (job_id, step, path, recorded_at) VALUES (?,?,?,?) "
                    "ON CONFLICT (job_id) DO UPDATE SET step = excluded.step, path = excluded.path, "
                    "recorded_at = excluded.recorded_at WHERE excluded.step >= checkpoints.step",
                    (job_id, int(step), str(path), now),
                )
        except sqlite3.IntegrityError:
            raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)") from None

    def last_checkpoint(self, job_id: str) -> CheckpointRecord | None:
        row = self._conn.execute(
            "SELECT job_id, step, path, recorded_at FROM checkpoints WHERE job_id = ?", (job_id,)
        ).fetchone()
        return CheckpointRecord(row[0], int(row[1]), row[2], float(row[3])) if row else None


_STATES = {s.value: s for s in JobState}


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
