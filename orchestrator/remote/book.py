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

from orchestrator.contract.errors import UserError

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

    def same(self, other: Target | None) -> bool:
        """The same login profile: the same name, and the same folder where both know theirs."""
        if other is None or other.name != self.name:
            return False
        return (
            self.profiles_dir is None or other.profiles_dir is None or self.profiles_dir == other.profiles_dir
        )

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
    """The profile whose login host has ``job_id`` (an array task ``A_i`` counts as its array ``A``).
    An id that two login hosts gave (two clusters count from their own numbers) is a UserError
    naming them: ``$ORCHESTRATOR_LOGIN`` says which is meant."""
    data = _load()
    jobs, clash = data.get("jobs", {}), data.get("clash", {})
    if not isinstance(jobs, dict) or not isinstance(clash, dict):
        return None
    key = job_id if job_id in jobs else job_id.split("_", 1)[0]
    if key in clash:
        names = ", ".join(t.name for v in clash[key] if (t := Target.from_json(v)) is not None)
        raise UserError(
            f"job {job_id}: that id was given by more than one login host ({names}); "
            f"say which with ORCHESTRATOR_LOGIN=PROFILE"
        )
    return Target.from_json(jobs.get(key))


def _book(data: dict[str, Any], target: Target, job: str) -> None:
    """``job`` is on ``target``'s login host; one that another login host gave too is a clash."""
    jobs = data.setdefault("jobs", {})
    old = Target.from_json(jobs.get(job))
    if old is not None and not old.same(target):
        clash = data.setdefault("clash", {})
        known = [t for v in clash.get(job, []) if (t := Target.from_json(v)) is not None] or [old]
        clash[job] = [t.to_json() for t in dict.fromkeys([*known, target])]
        data.get("final", {}).pop(job, None)  # whose row it was is no longer known
    jobs[job] = target.to_json()


def remember(target: Target, job_ids: list[str]) -> None:
    if not job_ids:
        return
    data = _load()
    for job in job_ids:
        _book(data, target, job)
    _store(data)


def final_row(job_id: str, target: Target | None = None) -> dict[str, Any] | None:
    """The status row of an ended job, as the login host last gave it; None when not ended or unknown
    (or, with ``target``, when that login host is not the one the row came from)."""
    data = _load()
    row = data.get("final", {}).get(job_id)
    if target is not None and (
        not target.same(Target.from_json(data.get("jobs", {}).get(job_id))) or job_id in data.get("clash", {})
    ):
        return None
    return row if isinstance(row, dict) else None


def remember_final(target: Target, rows: list[dict[str, Any]]) -> None:
    """Keep ended jobs' rows (and their profile); a row whose run continues elsewhere is not final."""
    if not rows:
        return
    data = _load()
    final = data.setdefault("final", {})
    for row in rows:
        job = str(row["job_id"])
        _book(data, target, job)
        final.pop(job, None)
        final[job] = row
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
