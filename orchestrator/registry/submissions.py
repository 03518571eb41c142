"""The registry's submission record: the intent written before the scheduler is asked, closed after.

A mixin of :class:`orchestrator.registry.store.Registry` (kept apart to keep that module to one job). The
reconciling itself (ask the scheduler for the token, adopt or clean up) is
:func:`orchestrator.runner.submission.reconcile_pending`; this module only reads and writes the rows.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: States of a submission row. Only ``pending`` is open.
PENDING = "pending"
SUBMITTED = "submitted"
ADOPTED = "adopted"
CANCELLED = "cancelled"
ABANDONED = "abandoned"
FAILED = "failed"


@dataclass(frozen=True)
class SubmissionIntent:
    token: str
    run_dir: Path
    attempt_base: int
    new_run_dir: bool
    scheduler: str
    job: dict[str, Any]
    """``Registry.add_job`` keywords (and ``resumed_from``) of the job this submission makes."""
    pid: int
    host: str
    created_at: float
    state: str
    job_id: str | None
    note: str | None

    def submitter_alive(self) -> bool:
        """Whether the submitting command may still be running (then its row is not an orphan). No
        submission takes an hour: an older row's pid is somebody else's by now."""
        age = time.time() - self.created_at
        if age > 3600:
            return False
        import socket  # here: `status` opens the registry on every call and never submits

        if self.host != socket.gethostname():
            return age < 600  # another host: give it ten minutes
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


_COLUMNS = (
    "token, run_dir, attempt_base, new_run_dir, scheduler, job, pid, host, created_at, state, job_id, note"
)


class SubmissionsMixin:
    _conn: sqlite3.Connection

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:  # provided by Registry
        raise NotImplementedError

    def begin_submission(
        self,
        token: str,
        run_dir: Path,
        attempt_base: int,
        new_run_dir: bool,
        scheduler: str,
        job: dict[str, Any],
    ) -> None:
        """Phase one, before the scheduler is asked: what is about to be submitted, and where."""
        import socket

        now = time.time()
        with self._write() as conn:
            conn.execute(
                f"INSERT OR REPLACE INTO submissions ({_COLUMNS}, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    token,
                    str(run_dir),
                    attempt_base,
                    int(new_run_dir),
                    scheduler,
                    json.dumps(job),
                    os.getpid(),
                    socket.gethostname(),
                    now,
                    PENDING,
                    None,
                    None,
                    now,
                ),
            )

    def end_submission(
        self, token: str, state: str, job_id: str | None = None, note: str | None = None
    ) -> None:
        """Phase two: the submission's outcome (``submitted``, ``adopted``, ``cancelled``, ...)."""
        with self._write() as conn:
            conn.execute(
                "UPDATE submissions SET state = ?, job_id = COALESCE(?, job_id), note = ?, updated_at = ? "
                "WHERE token = ?",
                (state, job_id, note, time.time(), token),
            )

    def submissions(self, state: str | None = None) -> list[SubmissionIntent]:
        where, params = ("WHERE state = ?", (state,)) if state else ("", ())
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM submissions {where} ORDER BY created_at", params
        ).fetchall()
        return list(_intents(rows))

    def has_pending_submissions(self) -> bool:
        """One indexed lookup: what every command pays when nothing needs reconciling."""
        row = self._conn.execute("SELECT 1 FROM submissions WHERE state = ? LIMIT 1", (PENDING,)).fetchone()
        return row is not None


def _intents(rows: list[Any]) -> Iterator[SubmissionIntent]:
    for r in rows:
        try:
            job = json.loads(r[5])
        except ValueError:
            job = {}
        yield SubmissionIntent(
            token=r[0],
            run_dir=Path(r[1]),
            attempt_base=int(r[2]),
            new_run_dir=bool(r[3]),
            scheduler=r[4],
            job=job if isinstance(job, dict) else {},
            pid=int(r[6]),
            host=r[7],
            created_at=float(r[8]),
            state=r[9],
            job_id=r[10],
            note=r[11],
        )
