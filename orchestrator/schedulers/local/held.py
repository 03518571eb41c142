"""When a local job held this machine: its "allocation", for ``orchestrator cost``.

There is no scheduler accounting on this machine, so each simulated node records its own span as it
ends (``logs/attempt_<A>/node_<N>.held.json``: its process's own start time, the end, the processes
and CPUs or GPUs it ran). A job's allocation runs from its first node's start to its last node's end,
on the sum of its nodes' resources: the processes' own wall clock times the CPUs (GPUs) they used.
A job that still runs is read from its living processes; one whose nodes were killed before they
could write (``kill -9``) from the times of the files it wrote. Every record is read defensively: a
field of the wrong type is left out, never a traceback.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contract.run_dir import (
    JOB_ID_FILE,
    LOCAL_PIDS_FILE,
    LOCAL_STATE_FILE,
    NODE_HELD_PATTERN,
    attempt_dir,
    attempt_dirs,
    read_json,
    write_json_atomic,
)

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.registry.store import JobRecord
    from orchestrator.schedulers.query import Allocation


NODE_HELD_RE = re.compile("^" + re.escape(NODE_HELD_PATTERN).replace(re.escape("{node}"), r"(\d+)") + "$")


def node_held_file(attempt_path: Path, node: int) -> Path:
    """A local node's own record of when its process held the machine (``cost``'s allocation)."""
    return Path(attempt_path) / NODE_HELD_PATTERN.format(node=node)


def _number(value: object) -> float | None:
    """A finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def process_start(pid: int | None = None) -> float | None:
    """The start time (epoch seconds) of process ``pid`` (this one by default), or None."""
    import psutil

    try:
        return float(psutil.Process(pid or os.getpid()).create_time())
    except (psutil.Error, OSError, ValueError):
        return None


def write_node_held(plan: LaunchPlan, run_dir: Path, attempt: int, node_rank: int, job_id: str) -> None:
    """This node's span (its process's start to now) and what it ran: called as the node ends."""
    procs = plan.procs_per_node
    record = {
        "job_id": job_id,
        "node": node_rank,
        "pid": os.getpid(),
        "start": process_start(),
        "end": time.time(),
        "procs": procs,
        "cpus": procs * max(1, plan.profile.cpus_per_task or 1),
        "gpus": 0 if plan.uses_cpu else procs,
    }
    try:
        write_json_atomic(node_held_file(attempt_dir(run_dir, attempt), node_rank), record)
    except OSError:
        pass  # a full disk: the bill falls back on the files' times


def read_held(attempt_path: Path) -> list[dict[str, Any]]:
    """The well-formed ``node_<N>.held.json`` records of one attempt folder: ``start``/``end`` finite
    numbers with end >= start; the counts non-negative whole numbers (else 0)."""
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(attempt_path))
    except OSError:
        return out
    for name in names:
        if not NODE_HELD_RE.match(name):
            continue
        data = read_json(Path(attempt_path) / name)
        if data is None:
            continue
        start, end = _number(data.get("start")), _number(data.get("end"))
        if start is None or end is None or end < start:
            continue
        job_id = data.get("job_id")
        out.append(
            {
                "job_id": job_id if isinstance(job_id, str) else "",
                "start": start,
                "end": end,
                "cpus": _count(data.get("cpus")),
                "gpus": _count(data.get("gpus")),
            }
        )
    return out


def _plan_resources(job: JobRecord, run_dir: Path) -> tuple[int, int]:
    """(cpus, gpus) of a job from its current plan (a job still running has written no record)."""
    from orchestrator.contract.run_dir import read_current_plan_json

    profile = read_current_plan_json(run_dir).get("profile")
    if not isinstance(profile, dict):
        profile = {}
    procs = job.nodes * job.procs_per_node
    gpus = 0 if not _count(profile.get("gpus_per_node")) else procs
    return procs * max(1, _count(profile.get("cpus_per_task"))), gpus


def _owns(job: JobRecord) -> bool:
    try:
        return (Path(job.run_dir) / JOB_ID_FILE).read_text().strip() in ("", job.job_id)
    except OSError:
        return False


def _living_start(run_dir: Path) -> float | None:
    """The earliest start of the local job's living node processes (the controller's children)."""
    import psutil

    pids = read_json(run_dir / LOCAL_PIDS_FILE) or {}
    controller = pids.get("controller")
    if not isinstance(controller, int) or isinstance(controller, bool) or controller <= 0:
        return None
    try:
        children = psutil.Process(controller).children(recursive=False)
        starts = [c.create_time() for c in children]
    except (psutil.Error, OSError):
        return None
    return min(starts, default=None)


def _file_span(attempt_path: Path) -> tuple[float, float] | None:
    """The first and last modification time of the files directly in an attempt folder: a job whose
    nodes wrote no record (killed before they could) is estimated from what it wrote."""
    times = []
    try:
        with os.scandir(attempt_path) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    times.append(entry.stat().st_mtime)
    except OSError:
        return None
    return (min(times), max(times)) if times else None


def job_allocations(job: JobRecord, alive: bool) -> list[Allocation]:
    """A local job's allocations: one per attempt folder its nodes recorded themselves in (a local job
    has one), else, while it is the run's newest job, its living processes or its files' times."""
    from orchestrator.schedulers.query import Allocation

    run_dir = Path(job.run_dir)
    found: list[Allocation] = []
    for _, path in attempt_dirs(run_dir):
        mine = [r for r in read_held(path) if r["job_id"] == job.job_id]
        if not mine:
            continue
        found.append(
            Allocation(
                job_id=job.job_id,
                submit=job.submitted_at,
                start=min(r["start"] for r in mine),
                end=None if alive else max(r["end"] for r in mine),
                gpus=sum(r["gpus"] for r in mine),
                cpus=sum(r["cpus"] for r in mine),
                nodes=len(mine),
                state="RUNNING" if alive else job.last_state.value,
            )
        )
    if found or not _owns(job):
        return found
    attempts = attempt_dirs(run_dir)
    cpus, gpus = _plan_resources(job, run_dir)
    start: float | None = None
    end: float | None = None
    if alive:
        start = _living_start(run_dir)
    if start is None and attempts:
        span = _file_span(attempts[-1][1])
        if span is not None:
            start, end = span
            if not alive:
                try:  # node 0 writes the outcome last
                    end = max(end, (run_dir / LOCAL_STATE_FILE).stat().st_mtime)
                except OSError:
                    pass
    if start is None:
        return []
    return [
        Allocation(
            job_id=job.job_id,
            submit=job.submitted_at,
            start=start,
            end=None if alive else end,
            gpus=gpus,
            cpus=cpus,
            nodes=job.nodes,
            state="RUNNING" if alive else job.last_state.value,
        )
    ]


def local_allocations(jobs: Sequence[JobRecord]) -> dict[str, list[Allocation]]:
    """Every job's allocations (:func:`job_allocations`); a job whose processes still hold the run is
    running (its allocation ends now)."""
    from orchestrator.contract import run_alive

    out: dict[str, list[Allocation]] = {}
    for job in jobs:
        alive = _owns(job) and run_alive.holders(Path(job.run_dir)) is not None
        out[job.job_id] = job_allocations(job, alive)
    return out
