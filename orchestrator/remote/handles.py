"""The Python API's jobs and sweeps on a login host: ``orchestrator.submit(profile=P, ...)`` where P
has ``login.host`` returns a :class:`RemoteJob`, whose calls are the login host's commands over the
connection (the same path as the command line's, :mod:`.client`).

Why the command line and not a pickled call: the two sides agree on argv and JSON, which are stable
across Python versions and checked by the version handshake; the keywords are turned into exactly
the flags ``orchestrator submit`` takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import UserError

_FLAGS = {"strategy": "--strategy", "nodes": "--nodes", "procs_per_node": "--procs-per-node", "name": "--name",
          "time": "--time", "max_requeues": "--max-requeues", "exclude": "--exclude",
          "hang_timeout": "--hang-timeout"}  # fmt: skip


def plan_flags(plan: Mapping[str, Any]) -> list[str]:
    """``make_plan``'s keywords as ``submit``'s flags (``--profile``, then the rest, then ``-- SCRIPT``)."""
    from orchestrator.config.options import OPTIONS

    words = ["--profile", str(plan["profile"])]
    for key, flag in _FLAGS.items():
        if plan.get(key) is not None:
            words += [flag, str(plan[key])]
    if plan.get("auto_resume"):
        words.append("--auto-resume")
    for after in plan.get("after") or ():
        words += ["--after", str(after)]
    by_name = {o.name: o for o in OPTIONS}
    for name, value in (plan.get("options") or {}).items():
        if name not in by_name:
            raise UserError(f"options: unknown option {name!r}")
        flag = by_name[name].flag
        words += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return [*words, "--", str(plan["script"]), *map(str, plan.get("args") or ())]


def _run(profile: str, argv: list[str]) -> str:
    from orchestrator.remote.client import run_captured

    rc, out, err = run_captured(profile, argv)
    if rc != 0:
        raise UserError(f"{argv[0]} on the login host of {profile}: {err.strip() or f'exit {rc}'}")
    return out


@dataclass(frozen=True)
class RemoteJob:
    """A job on a login host, seen from the laptop: the calls of :class:`orchestrator.api.Job` that a
    connection can carry (``status``, ``wait``, ``cancel``, ``logs``)."""

    job_id: str
    profile: str
    run_dir: Path
    """The run directory on the login host (its filesystem, not this machine's)."""

    def status(self) -> dict[str, Any]:
        """The job's ``status --json`` row."""
        (row,) = json.loads(_run(self.profile, ["status", self.job_id, "--json"]))["jobs"]
        return dict(row)

    def wait(self) -> str:
        """Follow the job to its end on the login host; its final state (``COMPLETED``, ...)."""
        from orchestrator.remote.client import run_captured

        run_captured(self.profile, ["wait", self.job_id])  # exit 1 is a failed job, not an error
        return str(self.status()["state"])

    def cancel(self, signal: str | None = None) -> str:
        """Cancel the job, or send it ``signal`` (``USR2``: checkpoint and requeue)."""
        return _run(self.profile, ["cancel", self.job_id, *(["--signal", signal] if signal else [])]).strip()

    def logs(self, node: int | None = None, tail: int | None = None) -> str:
        """The newest attempt's node logs, as ``orchestrator logs`` prints them."""
        words = [
            *(["--node", str(node)] if node is not None else []),
            *(["--tail", str(tail)] if tail else []),
        ]
        return _run(self.profile, ["logs", self.job_id, *words])


@dataclass(frozen=True)
class RemoteSweep:
    """A sweep on a login host: its id (its tasks may be started later, a few at a time)."""

    sweep_id: str
    profile: str

    def status(self) -> dict[str, Any]:
        """The sweep's ``status SWEEP --json`` (a row per task, the best one)."""
        return dict(json.loads(_run(self.profile, ["status", self.sweep_id, "--json"])))

    def wait(self) -> list[str]:
        """Follow every task to its end; each task's final state, in task order."""
        from orchestrator.remote.client import run_captured

        run_captured(self.profile, ["wait", self.sweep_id])  # exit 1: some task failed, not an error
        return [str(t["state"]) for t in sorted(self.status()["tasks"], key=lambda t: int(t["task"]))]


def submit(plan: Mapping[str, Any], snapshot: bool) -> RemoteJob:
    """``orchestrator submit`` on the login host (the script's folder is always sent: the login host
    has no other copy of it; ``snapshot`` is implied)."""
    out = _run(str(plan["profile"]), ["submit", *plan_flags(plan)])
    job = re.search(r"^submitted job (\S+)", out, re.MULTILINE)
    where = re.search(r"^run directory (.+)$", out, re.MULTILINE)
    if not job or not where:
        raise UserError(f"submit on the login host printed no job id: {out.strip()!r}")
    return RemoteJob(job.group(1), str(plan["profile"]), Path(where.group(1)))


def sweep(
    plan: Mapping[str, Any], grid: Mapping[str, Sequence[Any]], max_parallel: int | None
) -> RemoteSweep:
    """``orchestrator sweep`` on the login host: one ``--grid`` per axis."""
    words = [
        "sweep",
        *[w for axis, values in grid.items() for w in ("--grid", f"{axis}={','.join(map(str, values))}")],
    ]
    if max_parallel is not None:
        words += ["--max-parallel", str(max_parallel)]
    out = _run(str(plan["profile"]), [*words, *plan_flags(plan)])
    sweep_id = re.search(r"^submitted sweep (\S+)", out, re.MULTILINE)
    if not sweep_id:
        raise UserError(f"sweep on the login host printed no sweep id: {out.strip()!r}")
    return RemoteSweep(sweep_id.group(1), str(plan["profile"]))


def has_login(plan: Mapping[str, Any]) -> bool:
    """Whether ``plan``'s profile goes to a login host (never on the login host itself)."""
    import os

    from orchestrator.remote.routing import ON_LOGIN_HOST, login_profile

    name = plan.get("profile")
    return bool(name) and not os.environ.get(ON_LOGIN_HOST) and login_profile(str(name)) is not None
