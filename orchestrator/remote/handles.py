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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from orchestrator.config import inputs
from orchestrator.config.job_request import KEYWORDS, KEYWORDS_BY_NAME, JobRequest
from orchestrator.config.options import OPTIONS_BY_NAME
from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState
from orchestrator.remote.book import Target

#: ``orchestrator wait``'s exit status when its ``--timeout`` passed with the job still going.
_WAIT_TIMED_OUT = 124


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


def _run(target: Target, argv: list[str]) -> str:
    from orchestrator.remote.client import run_captured

    rc, out, err = run_captured(target, argv)
    if rc != 0:
        raise UserError(f"{argv[0]} on the login host of {target.name}: {err.strip() or f'exit {rc}'}")
    return out


def _wait(
    target: Target, what: str, timeout: float | None, poll: float, out: TextIO | None, until: str = "end"
) -> int:
    """``orchestrator wait`` on the login host, bounded by ``timeout`` there; its progress lines to
    ``out`` when it returns, and its exit code. Exit 1 is a job that failed (``until="checkpoint"``:
    that ended without a checkpoint), not an error; 124: :class:`TimeoutError`."""
    from orchestrator.remote.client import run_captured
    from orchestrator.runner.progress import WAIT_UNTIL

    timeout = inputs.seconds("timeout", timeout)
    poll = inputs.seconds("poll", poll, optional=False) or poll
    inputs.stream("out", out)
    inputs.choice("until", until, WAIT_UNTIL)
    words = [
        "wait",
        what,
        "--poll",
        repr(poll),
        *(["--timeout", repr(timeout)] if timeout is not None else []),
        *(["--for", until] if until != "end" else []),
    ]
    rc, text, err = run_captured(target, words)
    if out is not None:
        out.write(text)
    if rc == _WAIT_TIMED_OUT:
        raise TimeoutError(err.strip() or f"{what} still going after {timeout:g} s")
    if rc not in (0, 1):
        raise UserError(f"wait on the login host of {target.name}: {err.strip() or f'exit {rc}'}")
    return rc


class RemoteRecord(dict[str, Any]):
    """A JSON object a login host's command printed (``cost --json``...): every field is also an
    attribute, and ``to_json()`` gives it back, as the local call's record does."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    def to_json(self) -> dict[str, Any]:
        return dict(self)


class RemoteStatus(RemoteRecord):
    """A job's row of ``status --json`` on the login host, read as :class:`orchestrator.api.Job`'s
    ``status()`` is: ``state`` and ``run_state`` are :class:`JobState`, every other field of the row
    is an attribute (``step``, ``loss``, ``run_dir``, ...). Still the row itself (a dict: ``["state"]``
    is its text, ``json.dumps`` writes it)."""

    @property
    def state(self) -> JobState:
        return JobState(self["state"])

    @property
    def run_state(self) -> JobState:
        return JobState(self.get("run_state") or self["state"])


def run_json(target: Target, argv: list[str]) -> Any:
    """``argv`` (a command with ``--json``) on the login host of ``target``: what it printed, read."""
    return json.loads(_run(target, argv))


def run_text(target: Target, argv: list[str]) -> str:
    """``argv`` on the login host of ``target``: what it printed; a failure is its own line."""
    return _run(target, argv)


def job_of(target: Target, job_id: str) -> RemoteJob:
    """The handle of ``job_id`` on the login host of ``target`` (its run directory from its row)."""
    (row,) = run_json(target, ["status", job_id, "--json"])["jobs"]
    return RemoteJob(job_id, target.name, Path(row["run_dir"]), target.profiles_dir)


@dataclass(frozen=True)
class RemoteJob:
    """A job on a login host, seen from the laptop: the calls of :class:`orchestrator.api.Job` that a
    connection can carry (``status``, ``wait``, ``cancel``, ``logs``)."""

    job_id: str
    profile: str
    run_dir: Path
    """The run directory on the login host (its filesystem, not this machine's)."""
    profiles_dir: str | None = field(default=None, repr=False)
    """The laptop's folder the profile was loaded from (``profiles_dir=``), None: the usual search."""

    @property
    def _target(self) -> Target:
        return Target(self.profile, self.profiles_dir)

    def status(self) -> RemoteStatus:
        """The job's row of ``status --json``: ``.state`` (a JobState), ``.step``, ``.loss``..."""
        (row,) = json.loads(_run(self._target, ["status", self.job_id, "--json"]))["jobs"]
        return RemoteStatus(dict(row))

    def wait(
        self, timeout: float | None = None, poll: float = 2.0, out: TextIO | None = None, until: str = "end"
    ) -> JobState:
        """Follow the job to its end on the login host; its final state. ``timeout`` seconds passed:
        :class:`TimeoutError` (the job goes on). ``out``: where the progress lines go (default nowhere).
        ``until="checkpoint"``: only until its run has a complete checkpoint, and the job's state then;
        a run that ended without one raises :class:`orchestrator.api.NoCheckpoint`."""
        from orchestrator.runner.progress import NoCheckpoint

        rc = _wait(self._target, self.job_id, timeout, poll, out, until)
        if until == "checkpoint":
            state = self.status().state
            if rc != 0:
                raise NoCheckpoint(self.job_id, state)
            return state
        return self.status().run_state

    def cancel(self, signal: str | None = None) -> str:
        """Cancel the job, or send it ``signal`` (``USR2``: checkpoint and requeue)."""
        words = ["cancel", self.job_id, *(["--signal", signal] if signal else [])]
        return _run(self._target, words).strip()

    def logs(self, node: int | None = None, tail: int | None = None) -> str:
        """The newest attempt's node logs, as ``orchestrator logs`` prints them."""
        words = [
            *(["--node", str(node)] if node is not None else []),
            *(["--tail", str(tail)] if tail else []),
        ]
        return _run(self._target, ["logs", self.job_id, *words])


@dataclass(frozen=True)
class RemoteSweep:
    """A sweep on a login host: its id (its tasks may be started later, a few at a time)."""

    sweep_id: str
    profile: str
    profiles_dir: str | None = field(default=None, repr=False)

    @property
    def _target(self) -> Target:
        return Target(self.profile, self.profiles_dir)

    def status(self) -> dict[str, Any]:
        """The sweep's ``status SWEEP --json`` (a row per task, the best one)."""
        return dict(json.loads(_run(self._target, ["status", self.sweep_id, "--json"])))

    def wait(self, timeout: float | None = None, poll: float = 2.0, out: TextIO | None = None) -> list[str]:
        """Follow every task to its end; each task's final state, in task order. ``timeout`` seconds
        passed: :class:`TimeoutError` (the sweep goes on)."""
        _wait(self._target, self.sweep_id, timeout, poll, out)
        return [str(t["state"]) for t in sorted(self.status()["tasks"], key=lambda t: int(t["task"]))]


def submit(request: JobRequest, snapshot: bool) -> RemoteJob:
    """``orchestrator submit`` on the login host (the script's folder is always sent: the login host
    has no other copy of it; ``snapshot`` is implied)."""
    checked = request.checked()
    target = _target_of(checked)
    out = _run(target, ["submit", *plan_flags(checked)])
    job = re.search(r"^submitted job (\S+)", out, re.MULTILINE)
    where = re.search(r"^run directory (.+)$", out, re.MULTILINE)
    if not job or not where:
        raise UserError(f"submit on the login host printed no job id: {out.strip()!r}")
    return RemoteJob(job.group(1), target.name, Path(where.group(1)), target.profiles_dir)


def sweep(request: JobRequest, grid: Mapping[str, Sequence[Any]], max_parallel: int | None) -> RemoteSweep:
    """``orchestrator sweep`` on the login host: one ``--grid`` per axis."""
    checked = request.checked()
    target = _target_of(checked)
    words = [
        "sweep",
        *[w for axis, values in grid.items() for w in ("--grid", f"{axis}={','.join(map(str, values))}")],
    ]
    if max_parallel is not None:
        words += ["--max-parallel", str(max_parallel)]
    out = _run(target, [*words, *plan_flags(checked)])
    sweep_id = re.search(r"^submitted sweep (\S+)", out, re.MULTILINE)
    if not sweep_id:
        raise UserError(f"sweep on the login host printed no sweep id: {out.strip()!r}")
    return RemoteSweep(sweep_id.group(1), target.name, target.profiles_dir)


def _target_of(request: JobRequest) -> Target:
    from orchestrator.remote.routing import target

    folder = request.profiles_dir
    return target(str(request.profile), None if folder is None else str(folder))


def has_login(request: JobRequest) -> bool:
    """Whether the request's profile (from its ``profiles_dir`` when given) goes to a login host
    (never on the login host itself)."""
    import os

    from orchestrator.remote.routing import ON_LOGIN_HOST, login_profile

    name, folder = request.profile, request.profiles_dir
    if not name or os.environ.get(ON_LOGIN_HOST):
        return False
    return login_profile(str(name), None if folder is None else str(folder)) is not None
