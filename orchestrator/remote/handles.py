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

from orchestrator.config.job_request import KEYWORDS, KEYWORDS_BY_NAME, JobRequest
from orchestrator.config.options import OPTIONS_BY_NAME
from orchestrator.contract.errors import UserError


def plan_flags(request: JobRequest) -> list[str]:
    """The request as ``submit``'s flags, each keyword written as its ``form`` says
    (:mod:`orchestrator.config.job_request`): ``--profile`` first, then the rest, then ``-- SCRIPT
    ARGS``. A keyword the login host cannot use (``profiles_dir``: a folder on this laptop) is not
    sent; the values were checked here, as a local submit checks them."""
    words: list[str] = []
    tail: list[str] = ["--"]
    for k in KEYWORDS:
        value = getattr(request, k.name)
        form = k.spec.form
        if not k.spec.sent:
            continue
        if form == "option":  # the keyword, else the same name in options (as the plan reads it)
            value = request.given_options()[k.name]
        if form == "script":
            tail.insert(1, str(value))  # first after "--", whatever the declaration's order
        elif form == "args":
            tail += map(str, value)
        elif form in ("value", "option"):
            words += [] if value is None else [k.flag, str(value)]
        elif form == "switch":
            words += [k.flag] if value else []
        elif form == "each":
            words += [w for item in value for w in (k.flag, str(item))]
        elif form == "options":
            for name, given in request.given_options().items():
                if given is None or name in KEYWORDS_BY_NAME:  # not given; or sent as its own keyword
                    continue
                flag = OPTIONS_BY_NAME[name].flag
                words += (
                    [flag if given else "--no-" + flag[2:]] if isinstance(given, bool) else [flag, str(given)]
                )
        else:
            raise AssertionError(f"{k.name}: form {form!r} has no command-line words here")
    return [*words, *tail]


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


def submit(request: JobRequest, snapshot: bool) -> RemoteJob:
    """``orchestrator submit`` on the login host (the script's folder is always sent: the login host
    has no other copy of it; ``snapshot`` is implied)."""
    checked = request.checked()
    profile = str(checked.profile)
    out = _run(profile, ["submit", *plan_flags(checked)])
    job = re.search(r"^submitted job (\S+)", out, re.MULTILINE)
    where = re.search(r"^run directory (.+)$", out, re.MULTILINE)
    if not job or not where:
        raise UserError(f"submit on the login host printed no job id: {out.strip()!r}")
    return RemoteJob(job.group(1), profile, Path(where.group(1)))


def sweep(request: JobRequest, grid: Mapping[str, Sequence[Any]], max_parallel: int | None) -> RemoteSweep:
    """``orchestrator sweep`` on the login host: one ``--grid`` per axis."""
    checked = request.checked()
    profile = str(checked.profile)
    words = [
        "sweep",
        *[w for axis, values in grid.items() for w in ("--grid", f"{axis}={','.join(map(str, values))}")],
    ]
    if max_parallel is not None:
        words += ["--max-parallel", str(max_parallel)]
    out = _run(profile, [*words, *plan_flags(checked)])
    sweep_id = re.search(r"^submitted sweep (\S+)", out, re.MULTILINE)
    if not sweep_id:
        raise UserError(f"sweep on the login host printed no sweep id: {out.strip()!r}")
    return RemoteSweep(sweep_id.group(1), profile)


def has_login(request: JobRequest) -> bool:
    """Whether the request's profile goes to a login host (never on the login host itself)."""
    import os

    from orchestrator.remote.routing import ON_LOGIN_HOST, login_profile

    name = request.profile
    return bool(name) and not os.environ.get(ON_LOGIN_HOST) and login_profile(str(name)) is not None
