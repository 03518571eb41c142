"""The registry's sweeps: a grid of runs submitted together, each task an ordinary job.

A mixin of :class:`orchestrator.registry.store.Registry` (kept apart to keep that module to one job). A
sweep's tasks are jobs like any other (own run directory, attempts, history); ``sweep_tasks`` only
says which job is which grid point, so ``status``, ``logs`` and ``resume`` work on a task by its
job id, and ``status SWEEP`` rolls them up.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import UserError


@dataclass(frozen=True)
class SweepTask:
    task: int
    job_id: str
    params: dict[str, str]


@dataclass(frozen=True)
class SweepRecord:
    sweep_id: str
    name: str
    scheduler: str
    sweep_dir: Path
    grid: dict[str, list[str]]
    max_parallel: int
    created_at: float
    tasks: tuple[SweepTask, ...]

    @property
    def task_count(self) -> int:
        """Tasks of the sweep, one per grid point: started or not (a local sweep records its tasks
        as they start; ``list --sweeps`` counted only those, 0 for a sweep whose starter died)."""
        return math.prod(len(v) for v in self.grid.values())

    @property
    def job_ids(self) -> list[str]:
        return [t.job_id for t in self.tasks]

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep_id": self.sweep_id,
            "name": self.name,
            "scheduler": self.scheduler,
            "sweep_dir": str(self.sweep_dir),
            "grid": self.grid,
            "max_parallel": self.max_parallel,
            "task_count": self.task_count,
            "created_at": self.created_at,
            "tasks": [{"task": t.task, "job_id": t.job_id, "params": t.params} for t in self.tasks],
        }


class SweepsMixin:
    _conn: sqlite3.Connection

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:  # provided by Registry
        raise NotImplementedError

    def add_sweep(
        self,
        *,
        sweep_id: str,
        name: str,
        scheduler: str,
        sweep_dir: Path,
        grid: Mapping[str, Sequence[str]],
        max_parallel: int,
        tasks: Sequence[tuple[int, str, Mapping[str, str]]],
    ) -> None:
        """The sweep and its (task, job id, parameters), in one transaction; the jobs exist already."""
        with self._write() as conn:
            try:
                conn.execute(
                    "INSERT INTO sweeps (sweep_id, name, scheduler, sweep_dir, grid, max_parallel, created_at) "
                    "VALUES (?,?,?,?,?,?,?)",
                    (
                        sweep_id,
                        name,
                        scheduler,
                        str(sweep_dir),
                        json.dumps({k: list(v) for k, v in grid.items()}),
                        max_parallel,
                        time.time(),
                    ),
                )
            except sqlite3.IntegrityError:
                raise UserError(f"sweep id {sweep_id!r} is already in the registry") from None
            conn.executemany(
                "INSERT INTO sweep_tasks (sweep_id, task, job_id, params) VALUES (?,?,?,?)",
                [(sweep_id, task, job_id, json.dumps(dict(params))) for task, job_id, params in tasks],
            )

    def add_sweep_task(self, sweep_id: str, task: int, job_id: str, params: Mapping[str, str]) -> None:
        """A task started later than its sweep was recorded (a local sweep starts K at a time)."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO sweep_tasks (sweep_id, task, job_id, params) VALUES (?,?,?,?)",
                (sweep_id, task, job_id, json.dumps(dict(params))),
            )

    def find_sweep(self, sweep_id: str) -> SweepRecord | None:
        row = self._conn.execute(
            "SELECT sweep_id, name, scheduler, sweep_dir, grid, max_parallel, created_at FROM sweeps "
            "WHERE sweep_id = ?",
            (sweep_id,),
        ).fetchone()
        if row is None:
            return None
        tasks = tuple(
            SweepTask(int(t), str(j), json.loads(p))
            for t, j, p in self._conn.execute(
                "SELECT task, job_id, params FROM sweep_tasks WHERE sweep_id = ? ORDER BY task", (sweep_id,)
            )
        )
        return SweepRecord(
            sweep_id=row[0],
            name=row[1],
            scheduler=row[2],
            sweep_dir=Path(row[3]),
            grid=json.loads(row[4]),
            max_parallel=int(row[5]),
            created_at=float(row[6]),
            tasks=tasks,
        )

    def get_sweep(self, sweep_id: str) -> SweepRecord:
        sweep = self.find_sweep(sweep_id)
        if sweep is None:
            raise UserError(f"unknown sweep id '{sweep_id}' (see `orchestrator list --sweeps`)")
        return sweep

    def list_sweeps(self) -> list[SweepRecord]:
        ids = [r[0] for r in self._conn.execute("SELECT sweep_id FROM sweeps ORDER BY created_at DESC")]
        return [s for s in (self.find_sweep(i) for i in ids) if s is not None]

    def sweep_of(self, job_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
        """``{job id: (sweep id, task)}`` for the jobs that are sweep tasks."""
        if not job_ids:
            return {}
        marks = ",".join("?" * len(job_ids))
        return {
            str(j): (str(s), int(t))
            for s, t, j in self._conn.execute(
                f"SELECT sweep_id, task, job_id FROM sweep_tasks WHERE job_id IN ({marks})", list(job_ids)
            )
        }
