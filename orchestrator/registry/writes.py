"""The registry's write transactions and its local job ids.

A mixin of :class:`orchestrator.registry.store.Registry` (kept apart to keep that module to one job):
every write takes the lock up front, and a lock held too long by another process is one line naming
the file, never SQLite's "database is locked" traceback.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from orchestrator.contract.errors import UserError
from orchestrator.registry.schema import BUSY_TIMEOUT_MS, is_locked


class WritesMixin:
    _conn: sqlite3.Connection
    path: Path

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: take the write lock up front so read-then-write never deadlocks."""
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise self._locked(exc) from None
        try:
            yield conn
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and is_locked(exc):
                raise self._locked(exc) from None
            raise
        else:
            try:
                conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise self._locked(exc) from None

    def _locked(self, exc: sqlite3.OperationalError) -> Exception:
        """SQLite's "database is locked" after the busy timeout, as one line naming the file (a traceback
        before): another process has held the registry's write lock for that long, which no
        orchestrator command does, so it is something the user can find and end."""
        if not is_locked(exc):
            return exc
        return UserError(
            f"registry {self.path} is locked: another process has held its write lock for "
            f"{BUSY_TIMEOUT_MS // 1000} s (an open sqlite3 shell or a stuck command?); "
            "nothing was changed, try again when it ends"
        )

    def has_local_ids(self) -> bool:
        """Whether this registry has numbered a local job (its counter exists)."""
        row = self._conn.execute("SELECT 1 FROM counters WHERE name = 'local_job'").fetchone()
        return row is not None

    def seed_local_ids(self, highest: int) -> None:
        """A new registry's local ids go on after ``highest`` (the largest ``local-N`` already on
        disk): a deleted registry restarted at ``local-1`` while run directories of that id existed,
        so two runs claimed one id. A counter that exists is left as it is."""
        with self._write() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO counters (name, value) VALUES ('local_job', ?)", (int(highest),)
            )

    def allocate_local_id(self) -> str:
        """Next ``local-<n>`` id; atomic across processes and never reused."""
        with self._write() as conn:
            conn.execute("INSERT OR IGNORE INTO counters (name, value) VALUES ('local_job', 0)")
            conn.execute("UPDATE counters SET value = value + 1 WHERE name = 'local_job'")
            row = conn.execute("SELECT value FROM counters WHERE name = 'local_job'").fetchone()
        return f"local-{int(row[0])}"
