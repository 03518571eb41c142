"""The module-level calls that name a job, for a job this laptop submitted through a login host:
they act on that login host, as the command line does (``orchestrator wait JOB`` goes where the
book says, :mod:`orchestrator.remote.routing`), through the same commands a :class:`RemoteJob` runs.

Which calls follow: those given no ``registry`` and no ``home`` (a call given either asks that
registry, on this machine). Where they go is :func:`orchestrator.remote.routing.job_route`'s answer,
the one rule the command line keeps: ``$ORCHESTRATOR_LOGIN`` first (``-``: here), else the book; an
id this laptop's registry has too is refused, naming both. ``plot`` draws here from the run's
metrics fetched from there, as the command does. ``stacks``, ``export`` and ``resume`` answer with
objects of this machine (files, a handle with a local run directory): for a job on a login host they
are refused in one line naming the command that runs them there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.contract.errors import UserError
from orchestrator.remote import handles as remote
from orchestrator.remote.book import Target

if TYPE_CHECKING:
    from orchestrator.contract.job_states import JobState
    from orchestrator.runner.status import StatusReport


def login_of(job_id: str, registry: object = None, home: object = None) -> Target | None:
    """The login host a call naming ``job_id`` acts on; None: this machine's registry."""
    if registry is not None or home is not None:
        return None
    from orchestrator.remote.routing import job_route

    return job_route(job_id)


def one_login(call: str, job_ids: Sequence[str]) -> Target | None:
    """The one login host of every id in ``job_ids`` (None: all here); ids in two places are refused."""
    places = {job_id: login_of(job_id) for job_id in job_ids}
    where = set(places.values())
    if len(where) > 1:
        named = ", ".join(f"{j} ({'here' if t is None else t.name})" for j, t in places.items())
        raise UserError(f"{call}: these jobs are in different places: {named}; ask for each place's alone")
    return next(iter(where), None)


def status(target: Target, job_ids: Sequence[str], timeout_s: float) -> StatusReport:
    from orchestrator.runner.status import StatusReport

    data = remote.run_json(target, ["status", *job_ids, "--json", "--timeout", repr(timeout_s)])
    return StatusReport.from_json(data)


def wait(
    target: Target, job_id: str, poll: float, timeout: float | None, out: TextIO | None, until: str = "end"
) -> JobState:
    """``wait`` on the login host; the run's final state (``until="checkpoint"``: the job's state once
    its run has a complete checkpoint). ``timeout`` passed: :class:`WaitTimeout`."""
    from orchestrator.runner.progress import WaitTimeout

    job = remote.job_of(target, job_id)
    try:
        return job.wait(timeout=timeout, poll=poll, out=out, until=until)
    except TimeoutError:
        raise WaitTimeout(job_id, job.status().state) from None


def cost(target: Target, job_id: str, whole_run: bool, timeout_s: float) -> remote.RemoteRecord:
    words = ["cost", job_id, "--json", "--timeout", repr(timeout_s), *(["--run"] if whole_run else [])]
    return remote.RemoteRecord(remote.run_json(target, words))


def cancel(target: Target, job_id: str, sig: Any) -> str:
    from orchestrator.config.inputs import signal_value

    signum = signal_value(sig)  # refused here as there
    return remote.job_of(target, job_id).cancel(None if signum is None else signum.name)


def logs(
    target: Target, job_id: str, flags: dict[str, int | None], follow: bool, out: TextIO | None
) -> JobState | None:
    """``logs`` on the login host, printed to ``out`` (default stdout); ``follow``: to the job's end,
    and its final state."""
    import sys

    words = [w for name, value in flags.items() if value is not None for w in (f"--{name}", str(value))]
    text = remote.run_text(target, ["logs", job_id, *words, *(["--follow"] if follow else [])])
    (out or sys.stdout).write(text)
    return remote.job_of(target, job_id).status().run_state if follow else None


def plot(target: Target, job_id: str, output: str | None) -> Path:
    """The run's plot drawn here (into ``output`` or ``./<job>.png``), as ``orchestrator plot`` does."""
    from orchestrator.remote.client import plot_here

    return plot_here(target, job_id, output)


def refuse(call: str, job_id: str, target: Target, command: str) -> UserError:
    """The refusal of a call whose answer is an object of this machine (see the module's text)."""
    return UserError(
        f"{call}: job {job_id} is on the login host of {target.name} (submitted through it), and this "
        f"call answers with this machine's files; run `orchestrator {command} {job_id}`, which runs there"
    )
