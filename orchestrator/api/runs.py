"""The API's calls that read a job's run: its logs, its checkpoint as an export, its plot, its bill,
its ranks' stacks. Re-exported by :mod:`orchestrator.api` (``orchestrator.api.cost``...); each
checks its arguments at the door (:mod:`orchestrator.api.door`) before it opens anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.api import door
from orchestrator.api import follow as at_login
from orchestrator.api.door import COST_TARGET, EXPORT_RUN, JOB_ID
from orchestrator.config import inputs
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from orchestrator.contract.job_states import JobState
    from orchestrator.remote.handles import RemoteRecord
    from orchestrator.runner.cost import CostReport
    from orchestrator.runner.export import Exported
    from orchestrator.runner.stacks import Stacks


def logs(
    job_id: str,
    *,
    follow: bool = False,
    node: int | None = None,
    rank: int | None = None,
    attempt: int | None = None,
    tail: int | None = None,
    interval: float = 0.25,
    out: TextIO | None = None,
    err: TextIO | None = None,
    home: Path | str | None = None,
    resume_from: Mapping[str, Any] | None = None,
    framed: bool = False,
) -> JobState | None:
    """``logs``: print the selected node logs (or the last ``tail`` lines of each) to ``out`` (default
    stdout), notes to ``err``. ``follow``: keep printing until the job ends; its final state (None
    without ``follow``). ``framed``/``resume_from``: the resumable stream of ``core.logs.Resume``."""
    from orchestrator.runner.logs import Resume, show_logs

    with door.door("logs"):
        inputs.text("job_id", job_id, JOB_ID)
        inputs.flag("follow", follow)
        inputs.whole("node", node, 0)
        inputs.whole("rank", rank, 0)
        inputs.whole("attempt", attempt, 0)
        inputs.whole("tail", tail, 0)
        interval = inputs.seconds("interval", interval, optional=False) or interval
        inputs.stream("out", out)
        inputs.stream("err", err)
        inputs.mapping("resume_from", resume_from)
        inputs.flag("framed", framed)
        home = door.home(home)
    if (at := at_login.login_of(job_id, None, home)) is not None and not framed and not resume_from:
        flags = {"node": node, "rank": rank, "attempt": attempt, "tail": tail}
        return at_login.logs(at, job_id, flags, follow, out)
    with door.using(None, home) as registry:
        return show_logs(
            registry,
            job_id,
            follow=follow,
            node=node,
            rank=rank,
            attempt=attempt,
            tail=tail,
            interval=interval,
            out=out,
            err=err,
            framed=framed,
            resume_from=Resume(dict(resume_from)) if resume_from else None,
        )


def export(
    run: str | Path | None,
    out: str | Path,
    *,
    fmt: str = "safetensors",
    step: int | None = None,
    checkpoint: str | Path | None = None,
    dtype: str = "fp32",
    verify: bool = False,
    config: str | Path | None = None,
    say: Callable[[str], None] = print,
    home: Path | str | None = None,
) -> Exported:
    """A run's (job id or run directory) checkpoint as files inference tools read; the keywords and
    what they do: :func:`orchestrator.runner.export.export_run`. Imports torch."""
    from orchestrator.runner.export import DTYPES, FORMATS, export_run

    with door.door("export"):
        run = None if run is None else inputs.path_or_id("run", run, EXPORT_RUN)
        out_text = inputs.path_text("out", out) or ""
        inputs.choice("fmt", fmt, FORMATS)
        inputs.whole("step", step, 0, unit="a step number")
        checkpoint = inputs.path_text("checkpoint", checkpoint, optional=True)
        inputs.choice("dtype", dtype, DTYPES)
        inputs.flag("verify", verify)
        config = inputs.path_text("config", config, optional=True)
        if not callable(say):
            raise UserError(f"say: expected a function taking a line, got {say!r}")
        home = door.home(home)
    if run is not None and (at := at_login.login_of(str(run), None, home)) is not None:
        raise at_login.refuse("export", str(run), at, "export")
    return export_run(
        run,
        Path(out_text),
        home=home,
        fmt=fmt,
        step=step,
        checkpoint=checkpoint,
        dtype=dtype,
        verify=verify,
        config=config,
        say=say,
    )


def plot(job_id: str, output: str | Path | None = None, home: Path | str | None = None) -> Path:
    """Loss and throughput of the job's run to a PNG (default ``<run_dir>/plot.png``; a job on a login
    host: drawn here, default ``./<job>.png``, as ``orchestrator plot`` does); the file written."""
    with door.door("plot"):
        inputs.text("job_id", job_id, JOB_ID)
        inputs.path_text("output", output, optional=True)
        home = door.home(home)
    if (at := at_login.login_of(job_id, None, home)) is not None:  # drawn here, default ./<job>.png
        return at_login.plot(at, job_id, None if output is None else str(output))
    with door.using(None, home) as registry:
        job = registry.get(job_id)
    out = Path(output) if output else job.run_dir / "plot.png"
    if out.suffix.lower() != ".png":
        raise UserError(f"-o {out}: only PNG output is supported (name it *.png)")
    if not job.run_dir.is_dir():
        raise UserError(f"run directory {job.run_dir} of job {job.job_id} does not exist")
    if not out.parent.is_dir():
        # Never created here: a mistyped -o path should fail, not grow a tree of folders.
        raise UserError(f"-o {out}: folder {out.parent} does not exist")
    from orchestrator.rundir.plotting import plot_run

    return plot_run(job.run_dir, out, job_id=job.job_id)


def cost(
    target: str, *, whole_run: bool = False, timeout_s: float = 10.0, home: Path | str | None = None
) -> CostReport | RemoteRecord:
    """Where the allocated hours of a job, a run (a run directory, or a job with ``whole_run``) or a
    sweep went: productive, lost work, start-up, hang... (:mod:`orchestrator.runner.cost_model`). A job
    submitted through a login host: that host's bill, its ``cost --json`` (:mod:`.follow`)."""
    from orchestrator.runner.cost import cost_report

    with door.door("cost"):
        target = inputs.path_or_id("target", target, COST_TARGET)
        inputs.flag("whole_run", whole_run)
        timeout_s = inputs.seconds("timeout_s", timeout_s, optional=False) or timeout_s
        home = door.home(home)
    if (at := at_login.login_of(target, None, home)) is not None:
        return at_login.cost(at, target, whole_run, timeout_s)  # the login host's bill, as `cost --json`
    with door.using(None, home) as registry:
        return cost_report(registry, target, whole_run=whole_run, timeout_s=timeout_s)


def stacks(job_id: str, home: Path | str | None = None) -> Stacks:
    """Every rank's Python stack now (py-spy, on the job's nodes), saved in the run directory."""
    from orchestrator.runner.stacks import dump_stacks

    with door.door("stacks"):
        inputs.text("job_id", job_id, JOB_ID)
        home = door.home(home)
    if (at := at_login.login_of(job_id, None, home)) is not None:
        raise at_login.refuse("stacks", job_id, at, "stacks")
    with door.using(None, home) as registry:
        job = registry.get(job_id)
    return dump_stacks(job.job_id, Path(job.run_dir), job.scheduler)
