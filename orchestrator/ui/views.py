"""The dashboard's JSON answers, each built from the Python API (``status``'s own rows, ``sweep_status``,
``logs``, the run curves): the browser draws them, so every text reaches the page as data, never as
markup.

The jobs list pages the registry before asking anything: a 10,000-job registry costs one indexed
read of its rows plus ``status`` for one page (one batched scheduler query), not 10,000 run
directories per poll. A run's curves are followed (``api.get_job(id).curves()``): a poll
parses only what the run appended since the last one, and at most ``MAX_POINTS`` points a curve go
to the browser.

A deleted run directory is a 404 with a sentence on the job page, its chart and its logs, and the
run's followed curves and bill are dropped (not served from memory). Concurrent asks for the same
jobs page share one computation (:class:`_Shared`), and at most ``JOBS_AT_ONCE`` different ones run
at a time: 100 browsers polling a 10,000-job registry cost one read of it, not 100 copies in memory.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator import api
from orchestrator.contract.errors import RunFailure, UserError

#: Jobs per page of the jobs list.
PAGE_SIZE = 100
#: Points per curve sent to a browser (the server downsamples; spikes survive).
MAX_POINTS = 2000
#: Log lines shown by default, and the most a search looks through.
LOG_TAIL = 200
SEARCH_LINES = 20_000
#: Run pages whose curves are followed at once (least recently asked dropped first).
MAX_FOLLOWED = 64
#: A job's bill is asked of the scheduler's accounting at most this often.
COST_EVERY_S = 30.0
#: Different jobs pages (filters, page numbers) computed at once; the others wait their turn.
JOBS_AT_ONCE = 2

_COMMAND = re.compile(r"`(orchestrator [^`]+)`")


def _row(row: Any) -> dict[str, Any]:
    data: dict[str, Any] = row.to_json()
    data["state_detail"] = row.state_detail
    match = _COMMAND.search(row.reason or "")
    data["reason_command"] = match.group(1) if match else None
    return data


class Views:
    """The answers for one registry (``home``); shared by the server's threads."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home
        self._followers: dict[str, Any] = {}
        self._bills: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._jobs = _Shared(JOBS_AT_ONCE)

    # ------------------------------------------------------------------------ jobs
    def jobs(self, state: str = "", text: str = "", page: int = 0) -> dict[str, Any]:
        """One page of jobs, newest first, with their status rows; ``state``/``text`` filter the
        registry's rows (their last known state, their id or name) before the page is cut. Requests
        for the same page while it is being computed get that computation's answer."""
        state, text = state.strip().upper(), text.strip().lower()
        return self._jobs.get((state, text, page), lambda: self._jobs_page(state, text, page))

    def _jobs_page(self, state: str, text: str, page: int) -> dict[str, Any]:
        with api.open_registry(self.home) as registry:
            records = api.list_jobs(registry=registry)
            records.reverse()
            if state:
                records = [r for r in records if r.last_state.value == state]
            if text:
                records = [r for r in records if text in r.job_id.lower() or text in r.name.lower()]
            total = len(records)
            page = max(0, min(page, max(total - 1, 0) // PAGE_SIZE))
            chosen = [r.job_id for r in records[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]]
            report = api.status(chosen, registry=registry) if chosen else None
            sweeps = [
                {"sweep_id": s.sweep_id, "tasks": len(s.tasks), "name": s.name}
                for s in api.list_sweeps(registry=registry)[:20]
            ]
        rows = [_row(r) for r in report.rows] if report is not None else []
        return {
            "total": total,
            "page": page,
            "page_size": PAGE_SIZE,
            "jobs": rows,
            "stale_note": report.stale_note() if report is not None else None,
            "sweeps": sweeps,
        }

    # ------------------------------------------------------------------------ one job
    def _present(self, job_id: str) -> None:
        """A job whose run directory was deleted: its followed curves and bill are dropped, and a
        404 says why (not a 500, not the curves from memory)."""
        with api.open_registry(self.home) as registry:
            run_dir = Path(registry.get(job_id).run_dir)
        if run_dir.is_dir():
            return
        with self._lock:
            self._followers.pop(job_id, None)
            self._bills.pop(job_id, None)
        raise RunGone(f"job {job_id}: its run directory {run_dir} no longer exists (deleted)")

    def job(self, job_id: str) -> dict[str, Any]:
        """The job's status row, its attempts and nodes, the hang report, and its curves."""
        self._present(job_id)
        with api.open_registry(self.home) as registry:
            report = api.status([job_id], registry=registry)
            record = registry.get(job_id)
        assert report is not None
        row = report.rows[0]
        details = api.Job(record.job_id, record.run_dir, self.home).details()  # this registry's job
        return {
            "job": _row(row),
            "command": list(record.command),
            "profile": record.profile,
            "details": details,
            "liveness_lines": report.liveness_lines(),
            "failure_lines": report.failure_lines(),
            "chart": self.chart(job_id),
        }

    def chart(self, job_id: str) -> dict[str, Any]:
        """The run's curves, downsampled to ``MAX_POINTS`` each; resume points as steps."""
        self._present(job_id)
        follower = self._follower(job_id)
        with follower.lock:
            full = follower.value.update().series()
            events = follower.value.events
        series = full.thinned(MAX_POINTS)
        curves: dict[str, Any] = {}
        for name, steps, values, points in (
            ("loss", series.train_steps, series.train_loss, len(full.train_steps)),
            ("val_loss", series.val_steps, series.val_loss, len(full.val_steps)),
            ("tokens_per_s", series.tps_steps, series.tokens_per_s, len(full.tps_steps)),
            ("steps_per_s", series.sps_steps, series.steps_per_s, len(full.sps_steps)),
        ):
            if steps:
                curves[name] = {"x": steps, "y": values, "points": points}
        return {
            "events": events,
            "curves": curves,
            "resumes": [{"step": s, "checkpoint": c} for s, c in series.resumes],
            "strategy": series.strategy,
            "world_size": series.world_size,
        }

    def cost(self, job_id: str) -> dict[str, Any]:
        """The job's run bill (``orchestrator cost JOB --run``), asked of the scheduler's accounting at
        most every ``COST_EVERY_S`` per job however often pages poll."""
        now = time.monotonic()
        with self._lock:
            cached = self._bills.get(job_id)
        if cached is not None and now - cached[0] < COST_EVERY_S:
            return cached[1]
        bill: dict[str, Any] = api.cost(job_id, whole_run=True, home=self.home).to_json()
        with self._lock:
            self._bills[job_id] = (now, bill)
            while len(self._bills) > MAX_FOLLOWED:
                self._bills.pop(next(iter(self._bills)))
        return bill

    def _follower(self, job_id: str) -> Any:
        with self._lock:
            entry = self._followers.pop(job_id, None)
            if entry is None:
                with api.open_registry(self.home) as registry:  # this registry's job, never a login host's
                    record = registry.get(job_id)
                entry = _Followed(api.Job(record.job_id, record.run_dir, self.home).curves())
            self._followers[job_id] = entry  # newest last
            while len(self._followers) > MAX_FOLLOWED:
                self._followers.pop(next(iter(self._followers)))
            return entry

    def logs(
        self, job_id: str, node: int | None = None, rank: int | None = None, search: str = ""
    ) -> dict[str, Any]:
        """The newest attempt's log tail (``orchestrator logs --tail``), or the lines holding
        ``search`` among its last ``SEARCH_LINES``; a log that is a symlink out of the run is not
        read (a note says so)."""
        self._present(job_id)
        out, err = io.StringIO(), io.StringIO()
        tail = SEARCH_LINES if search else LOG_TAIL
        try:
            api.logs(job_id, node=node, rank=rank, tail=tail, out=out, err=err, home=self.home)
        except RunFailure as exc:  # the run directory went away since _present looked
            raise RunGone(str(exc)) from None
        lines = out.getvalue().splitlines()
        if search:
            needle = search.lower()
            lines = [ln for ln in lines if needle in ln.lower()][-LOG_TAIL:]
        cmd = f"orchestrator logs {job_id}"
        if node is not None:
            cmd += f" --node {node}"
        if rank is not None:
            cmd += f" --rank {rank}"
        return {"lines": lines, "notes": err.getvalue().splitlines(), "command": cmd}

    # ------------------------------------------------------------------------ sweeps
    def sweep(self, sweep_id: str, metric: str = "loss") -> dict[str, Any]:
        """The sweep's tasks (grid point, state, metric), the best one, and the grid's axes."""
        if metric not in api.SWEEP_METRICS:
            raise UserError(f"metric {metric!r}: expected one of {', '.join(api.SWEEP_METRICS)}")
        with api.open_registry(self.home) as registry:
            status = api.sweep_status(registry, sweep_id, metric, 5.0)
        tasks = [
            {"task": task, "params": params, "row": _row(row), "metric": getattr(row, metric)}
            for task, params, row in zip(status.tasks, status.params, status.rows, strict=True)
        ]
        waiting: list[dict[str, Any]] = [
            {"task": t, "params": p, "state": "QUEUED", "reason": None} for t, p in status.queued
        ]
        waiting += [
            {"task": t, "params": p, "state": "FAILED", "reason": r} for t, p, r in status.not_started
        ]
        waiting += [{"task": t, "params": p, "state": "BUDGET", "reason": r} for t, p, r in status.refused]
        axes = sorted({k for _, _, p in _points(status) for k in p})
        return {
            "sweep_id": sweep_id,
            "metric": metric,
            "higher_is_better": api.SWEEP_METRICS[metric],
            "best_task": status.tasks[status.best] if status.best is not None else None,
            "counts": status.counts(),
            "total": status.total,
            "axes": axes,
            "tasks": tasks,
            "waiting": waiting,
        }


def _points(status: Any) -> list[tuple[int, str, dict[str, str]]]:
    """Every task's grid point: started, queued, or not started."""
    out = [(t, "started", p) for t, p in zip(status.tasks, status.params, strict=True)]
    out += [(t, "queued", p) for t, p in status.queued]
    out += [(t, "not started", p) for t, p, _ in status.not_started]
    out += [(t, "refused", p) for t, p, _ in status.refused]
    return out


class RunGone(UserError):
    """The job is in the registry but its run directory is gone (the server answers 404)."""


class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class _Shared:
    """Single flight: callers asking for the same key while its computation runs wait for it and
    share its answer (nothing is kept after it ends: the next poll computes afresh); at most
    ``at_once`` computations of different keys run together."""

    def __init__(self, at_once: int) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Any, _Flight] = {}
        self._slots = threading.BoundedSemaphore(at_once)

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if leader:
            try:
                with self._slots:
                    flight.value = compute()
            except BaseException as exc:
                flight.error = exc
            finally:
                with self._lock:
                    del self._flights[key]
                flight.done.set()
        else:
            flight.done.wait()
        if flight.error is not None:
            raise flight.error
        return flight.value


class _Followed:
    """A run's follower and the lock its parse holds (two tabs on one run share one parse)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.lock = threading.Lock()
