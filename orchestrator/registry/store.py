"""The job registry: one SQLite file that remembers every job this user submitted.

Why SQLite and not a JSON file per job: ``status`` over 1,000 jobs must be one query, several
``submit`` processes may write at the same time (a sweep launched from a shell loop), and a
half-written JSON file after Ctrl-C would lose jobs. SQLite in WAL mode gives atomic commits,
concurrent readers with one writer, and ``busy_timeout`` makes writers queue instead of failing.

Location: ``$ORCHESTRATOR_HOME/registry.db`` (default ``~/.orchestrator``). The directory is
created 0700 and the file 0600 because run directories and commands may reveal private paths.

A run is a run directory and every job that trained in it (``resume`` and ``--auto-resume`` submit
a new job into the same directory); the run's newest job is where its older jobs continue, which is
what ``status``, ``cancel``, ``resume`` and ``submit --wait`` follow. Attempts are the starts of one
job id (its submission, then each Slurm requeue).

The registry never deletes or rewrites a file it cannot read: a corrupt file is reported as a
:class:`~orchestrator.contract.errors.UserError` naming the path, and the user decides what to do with it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.config.inputs import env_folder, registry_home
from orchestrator.config.scheduler_kinds import SCHEDULER_NAMES
from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState, parse_state
from orchestrator.registry.schema import (
    BUSY_TIMEOUT_MS,
    JOB_COLUMNS,
    MIGRATIONS,
    SCHEMA_VERSION,
    Attempt,
    BadRow,
    JobRecord,
    RunRecord,
    SchedulerKind,
    StateChange,
    is_corruption,
    job_from_row,
    migrate,
    retry_when_locked,
    schema_version,
)
from orchestrator.registry.submissions import SubmissionsMixin
from orchestrator.registry.sweeps import SweepsMixin
from orchestrator.registry.writes import WritesMixin

__all__ = [
    "BUSY_TIMEOUT_MS",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Attempt",
    "JobRecord",
    "Registry",
    "RunRecord",
    "SchedulerKind",
    "StateChange",
    "default_home",
]

REGISTRY_FILENAME = "registry.db"
HOME_ENV = "ORCHESTRATOR_HOME"


def default_home() -> Path:
    """``$ORCHESTRATOR_HOME`` if set, else ``~/.orchestrator`` (set but empty: a UserError)."""
    return env_folder(HOME_ENV, Path.home() / ".orchestrator")


class Registry(WritesMixin, SubmissionsMixin, SweepsMixin):
    """Handle on the registry database. Cheap to open; use as a context manager or call close()."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path
        self.bad_rows: list[str] = []
        """Rows a listing skipped because they cannot be read (one line each, for stderr)."""

    # ------------------------------------------------------------------ opening / migrations
    @classmethod
    def open(cls, home: Path | None = None, create: bool = True) -> Registry:
        """Open (creating if needed) ``<home>/registry.db`` and bring its schema up to date;
        ``create=False`` (the API's reads given a ``home``): none there is a UserError, none made."""
        home = Path(home).expanduser() if home is not None else default_home()
        path = home / REGISTRY_FILENAME
        if not create:
            registry_home("home", home, REGISTRY_FILENAME)
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
            mode = retry_when_locked(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
            if mode is None or str(mode[0]).lower() != "wal":
                # A network file system without shared memory refuses WAL; rollback mode still
                # works (with less concurrency), so carry on rather than refuse to run.
                pass
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            retry_when_locked(lambda: migrate(conn, path))
        except sqlite3.DatabaseError as exc:
            conn.close()
            if is_corruption(exc):
                raise UserError(
                    f"registry {path} is not a readable SQLite database ({exc}); "
                    "it was left untouched -- move it aside to start a new registry"
                ) from None
            raise UserError(f"cannot use registry {path}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        return cls(conn, path)

    @property
    def schema_version(self) -> int:
        return schema_version(self._conn)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs
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
        """Insert a new job, its first state-history entry and its place in the run of ``run_dir``
        (a new run when the directory is new) in one transaction.

        One transaction under the write lock, so two ``resume``s racing into one run directory
        still make one run and number its jobs apart. A duplicate id is a UserError: Slurm ids
        restart at 1 after a cluster state wipe, and silently overwriting an old job's row would
        point ``status`` at the wrong run directory.
        """
        if scheduler not in SCHEDULER_NAMES:
            raise UserError(f"scheduler must be 'slurm' or 'local', not {scheduler!r}")
        now = time.time() if submitted_at is None else submitted_at
        run_dir_s = str(Path(run_dir).expanduser().absolute())
        try:
            with self._write() as conn:
                conn.execute(
                    "INSERT OR IGNORE INTO runs (run_dir, created_at) VALUES (?, ?)", (run_dir_s, now)
                )
                run_id, run_seq = conn.execute(
                    "SELECT r.run_id, (SELECT COALESCE(MAX(j.run_seq) + 1, 0) FROM jobs j WHERE j.run_id = r.run_id) "
                    "FROM runs r WHERE r.run_dir = ?",
                    (run_dir_s,),
                ).fetchone()
                conn.execute(
                    f"INSERT INTO jobs ({JOB_COLUMNS}, run_id, run_seq) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                        run_id,
                        run_seq,
                    ),
                )
                conn.execute(
                    "INSERT INTO state_history (job_id, state, at, source) VALUES (?,?,?,?)",
                    (job_id, state.value, now, source),
                )
        except sqlite3.IntegrityError as exc:
            if "jobs.job_id" in str(exc):
                raise UserError(f"job id {job_id!r} is already in the registry {self.path}") from None
            raise UserError(f"invalid job record for {job_id!r}: {exc}") from None
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord:
        """The job's row; an unknown id is a user error that points at ``orchestrator list``."""
        row = self._conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)")
        return job_from_row(row)

    def _records(self, rows: Iterable[Sequence[Any]]) -> list[JobRecord]:
        """The rows' records, skipping a row that cannot be read: one bad row (edited by hand) made
        `list` and `status` fail for every job. Each skipped row is one line in :attr:`bad_rows`."""
        records = []
        for row in rows:
            try:
                records.append(job_from_row(row))
            except BadRow as exc:
                self.bad_rows.append(f"{exc}; skipped (fix or delete that row in {self.path})")
        return records

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
            f"SELECT {JOB_COLUMNS} FROM jobs {where} ORDER BY submitted_at, job_id", params
        ).fetchall()
        return self._records(rows)

    def active_and_recent(self, recent_s: float = 24 * 3600.0, now: float | None = None) -> list[JobRecord]:
        """Non-terminal jobs plus any job submitted or changed state within ``recent_s`` seconds."""
        now = time.time() if now is None else now
        terminal = [s.value for s in JobState if s.is_terminal()]
        rows = self._conn.execute(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE last_state NOT IN ({','.join('?' * len(terminal))}) "
            "OR last_state_at >= ? OR submitted_at >= ? ORDER BY submitted_at, job_id",
            (*terminal, now - recent_s, now - recent_s),
        ).fetchall()
        return self._records(rows)

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

    def scheduler_columns(self, job_ids: Iterable[str]) -> dict[str, tuple[Any, ...]]:
        """``{job_id: (last_state, node_list, exit_code, reason)}`` of the ids that exist: what
        :meth:`record_states` and :meth:`set_scheduler_info` compare against, read once for both."""
        return self._columns(job_ids, "last_state, node_list, exit_code, reason")

    def record_states(
        self,
        states: Mapping[str, JobState],
        source: str,
        at: float | None = None,
        current: Mapping[str, tuple[Any, ...]] | None = None,
    ) -> list[str]:
        """Batch form of :meth:`record_state` in one transaction (``status`` over 1,000 jobs).

        Unknown ids are ignored here; returns the ids whose state changed. ``current``: what
        :meth:`scheduler_columns` read just before (else it is read here).
        """
        if not states:
            return []
        # Read first, write only what differs: a poll where nothing changed (the usual case) then
        # takes no write lock and writes nothing, instead of 1,000 no-op UPDATEs under the lock.
        if current is None:
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
        current: Mapping[str, tuple[Any, ...]] | None = None,
    ) -> None:
        """Store ``{job_id: (node_list, exit_code, reason)}`` from the scheduler, keeping old values
        where it now reports nothing (its accounting forgets, the registry should not).
        ``current``: what :meth:`scheduler_columns` read just before (else it is read here)."""
        if not info:
            return
        if current is None:
            current = self.scheduler_columns(info)
        todo = {
            j: v
            for j, v in info.items()
            if j in current
            and tuple(new or old for new, old in zip(v, current[j][1:], strict=True)) != current[j][1:]
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
        if job_ids is None:
            rows = self._conn.execute("SELECT job_id, COUNT(*) FROM attempts GROUP BY job_id").fetchall()
            return {r[0]: int(r[1]) for r in rows}
        # Only the ids asked (primary-key lookups, 500 per query): a registry of 10,000 finished
        # jobs must not cost `status` a row per finished job's attempt.
        asked = list(dict.fromkeys(job_ids))
        counts: dict[str, int] = {}
        for i in range(0, len(asked), 500):
            chunk = asked[i : i + 500]
            rows = self._conn.execute(
                f"SELECT job_id, COUNT(*) FROM attempts WHERE job_id IN ({','.join('?' * len(chunk))}) "
                "GROUP BY job_id",
                chunk,
            ).fetchall()
            counts.update((r[0], int(r[1])) for r in rows)
        return {j: counts.get(j, 0) for j in asked}

    def successors(self, job_ids: Iterable[str]) -> dict[str, str]:
        """``{job_id: the job its run continues in}``: the run's newest job, for each job that is not
        itself its run's newest (its run went on through ``resume`` or ``--auto-resume``).

        ``status`` asks this for every row, so it is one indexed query per 500 ids, never one per
        job; ids without a successor (and unknown ids) are absent.
        """
        asked = list(dict.fromkeys(job_ids))
        found: dict[str, str] = {}
        for i in range(0, len(asked), 500):  # under SQLite's bound-parameter limit on any version
            chunk = asked[i : i + 500]
            rows = self._conn.execute(
                "SELECT j.job_id, n.job_id FROM jobs j JOIN jobs n ON n.run_id = j.run_id "
                "AND n.run_seq = (SELECT MAX(m.run_seq) FROM jobs m WHERE m.run_id = j.run_id) "
                f"WHERE j.job_id IN ({','.join('?' * len(chunk))}) AND n.run_seq > j.run_seq",
                chunk,
            ).fetchall()
            found.update((r[0], r[1]) for r in rows)
        return {j: found[j] for j in asked if j in found}

    # ------------------------------------------------------------------ runs
    def run_of(self, job_id: str) -> RunRecord:
        """The run the job belongs to, with all its jobs; an unknown id is a user error."""
        row = self._conn.execute("SELECT run_id FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        run = self._run_where("run_id = ?", row[0]) if row is not None and row[0] is not None else None
        if run is None:
            raise UserError(f"unknown job id '{job_id}' (see `orchestrator list`)")
        return run

    def run_at(self, run_dir: Path | str) -> RunRecord | None:
        """The run that trains in ``run_dir`` (spelled as ``add_job`` stores it), None if no job did."""
        return self._run_where("run_dir = ?", str(Path(run_dir).expanduser().absolute()))

    def _run_where(self, clause: str, value: object) -> RunRecord | None:
        row = self._conn.execute(
            f"SELECT run_id, run_dir, created_at FROM runs WHERE {clause}", (value,)
        ).fetchone()
        if row is None:
            return None
        jobs = self._conn.execute(
            "SELECT job_id FROM jobs WHERE run_id = ? ORDER BY run_seq", (row[0],)
        ).fetchall()
        if not jobs:
            return None
        return RunRecord(int(row[0]), Path(row[1]), float(row[2]), tuple(j[0] for j in jobs))
