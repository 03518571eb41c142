"""The laptop's book of jobs it started on login hosts: job id -> profile, and ended jobs' final rows.

Why: ``status JOB`` and ``logs JOB`` name no profile, yet must go to the login host that has the
job; and a job that has ended never changes its row, so ``status`` shows it from here, at no round
trip. One JSON file under ``$ORCHESTRATOR_HOME`` (``remote_jobs.json``), replaced atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_NAME = "remote_jobs.json"
#: Ended jobs' rows kept (the newest); an older one is simply asked for again.
MAX_FINAL_ROWS = 5000


@dataclass(frozen=True)
class Target:
    """A laptop's profile with ``login.host``: its name and the folder it was loaded from
    (``--profiles-dir``; None: the usual search), so every later command finds the same file."""

    name: str
    profiles_dir: str | None = None

    def to_json(self) -> str | list[str]:
        return self.name if self.profiles_dir is None else [self.name, self.profiles_dir]

    @classmethod
    def from_json(cls, value: object) -> Target | None:
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            return cls(value[0], value[1])
        return None


def _path() -> Path:
    from orchestrator.registry.store import default_home

    return default_home() / FILE_NAME


def _load() -> dict[str, Any]:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {"jobs": {}, "final": {}}
    return data if isinstance(data, dict) else {"jobs": {}, "final": {}}


def _store(data: dict[str, Any]) -> None:
    path = _path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".remote_jobs.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def profile_of(job_id: str) -> Target | None:
    """The profile whose login host has ``job_id`` (an array task ``A_i`` counts as its array ``A``)."""
    jobs = _load().get("jobs", {})
    if not isinstance(jobs, dict):
        return None
    return Target.from_json(jobs.get(job_id) or jobs.get(job_id.split("_", 1)[0]))


def remember(target: Target, job_ids: list[str]) -> None:
    if not job_ids:
        return
    data = _load()
    data.setdefault("jobs", {}).update({j: target.to_json() for j in job_ids})
    _store(data)


def final_row(job_id: str) -> dict[str, Any] | None:
    """The status row of an ended job, as the login host last gave it; None when not ended or unknown."""
    row = _load().get("final", {}).get(job_id)
    return row if isinstance(row, dict) else None


def remember_final(target: Target, rows: list[dict[str, Any]]) -> None:
    """Keep ended jobs' rows (and their profile); a row whose run continues elsewhere is not final."""
    if not rows:
        return
    data = _load()
    final = data.setdefault("final", {})
    for row in rows:
        job = str(row["job_id"])
        final.pop(job, None)
        final[job] = row
        data.setdefault("jobs", {})[job] = target.to_json()
    for job in list(final)[: max(0, len(final) - MAX_FINAL_ROWS)]:  # the oldest go: asked again if named
        del final[job]
    _store(data)


def elsewhere_note(command: str) -> str | None:
    """A line for ``status``/``list`` run here with no job named: the jobs this laptop submitted
    through login hosts are not in its registry, and the command that shows them; None: none booked."""
    jobs = _load().get("jobs", {})
    counts: dict[str, int] = {}
    for value in jobs.values() if isinstance(jobs, dict) else ():
        target = Target.from_json(value)
        if target is not None:
            counts[target.name] = counts.get(target.name, 0) + 1
    if not counts:
        return None
    where = ", ".join(f"{n} through {name}" for name, n in sorted(counts.items()))
    first = min(counts)
    return (
        f"note: jobs submitted from here through a login host are there, not in this registry ({where}): "
        f"`ORCHESTRATOR_LOGIN={first} orchestrator {command}`, or `orchestrator {command} JOB`"
    )
