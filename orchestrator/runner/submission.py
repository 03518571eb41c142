"""Submission: the side-effecting half of ``submit`` and ``resume`` (run directory, scheduler, registry).

Order matters: everything is validated (plan, script, the cluster's own limits, the run root) before
the run directory is created or the scheduler is touched, so a refused request leaves nothing
behind. The text submitted is the request :meth:`Scheduler.dryrun` made, the same one ``--dry-run``
prints.

Submission is a two-phase record, so a command killed at any point leaves nothing unknown:

1. the attempt's plan file is created exclusively (:func:`run_dir.reserve_attempt`) and the intent
   (run directory, attempt, the token the scheduler job carries, e.g. Slurm's ``--comment``) goes
   into the registry before the scheduler is asked;
2. after the scheduler answered, the job is recorded and the intent closed.

A command that dies between the two leaves the intent open; :func:`reconcile`, run by the next
command that reads jobs, asks the scheduler for the token and adopts the job it finds (or cancels it,
saying why), or removes what the submission had made when the scheduler never got it. Changes to an
existing run (resume, auto-resume) hold its lock (:func:`run_lock.run_lock`) across their checks
and the submission.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config.inputs import env_folder
from orchestrator.config.plan import LaunchPlan
from orchestrator.config.render import accelerate_launch_command
from orchestrator.contract import start_estimates
from orchestrator.contract.errors import OrchestratorError, UserError
from orchestrator.contract.permissions import run_dir_mode, run_umask, umask
from orchestrator.contract.run_dir import (
    CANCEL_MARKER,
    JOB_ID_FILE,
    SNAPSHOT_DIR,
    attempt_dir,
    plan_file,
    reserve_attempt,
    set_current_plan,
)
from orchestrator.contract.run_name import name_run
from orchestrator.notify.events import prepare as prepare_notify
from orchestrator.rundir.lock import RunLocked, run_lock
from orchestrator.runner.snapshot import copy_snapshot, plan_snapshot
from orchestrator.schedulers import get_scheduler
from orchestrator.schedulers.base import submission_token

if TYPE_CHECKING:
    from orchestrator.registry.store import Registry
    from orchestrator.registry.submissions import SubmissionIntent
    from orchestrator.schedulers.base import Request, Scheduler

#: What the plan's recorded command shows where the node's own config path goes.
NODE_CONFIG_PLACEHOLDER = "<node config>"


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: Path
    scheduler: str
    submitit_job: Any = None


def runs_root() -> Path:
    """Where run directories go: $ORCHESTRATOR_RUNS or ./runs (must be on a shared filesystem for Slurm)."""
    return env_folder("ORCHESTRATOR_RUNS", "runs").absolute()


def check_runs_root() -> Path:
    """The run root can take a new run directory: refused here, before anything is submitted."""
    root = runs_root()
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    where = f"ORCHESTRATOR_RUNS={root}" if "ORCHESTRATOR_RUNS" in os.environ else f"run root {root}"
    if not existing.is_dir():
        raise UserError(
            f"{where}: {existing} is not a directory; set $ORCHESTRATOR_RUNS to a writable folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{where}: {existing} is not writable; set $ORCHESTRATOR_RUNS to a writable folder")
    return root


_LOCAL_ID = re.compile(r"^local-(\d+)\Z")


def highest_local_id(root: Path) -> int:
    """The largest N of the ``local-N`` ids run directories under ``root`` hold (their
    ``job_id`` files, a sweep's tasks included); 0 when there are none. Read once per new registry."""
    highest = 0
    for pattern in (f"*/{JOB_ID_FILE}", f"*/task_*/{JOB_ID_FILE}"):
        for path in root.glob(pattern):
            try:
                m = _LOCAL_ID.match(path.read_text(encoding="utf-8", errors="replace").strip())
            except OSError:
                continue
            if m:
                highest = max(highest, int(m.group(1)))
    return highest


def check_script(plan: LaunchPlan) -> None:
    if not Path(plan.script).is_file():
        raise UserError(f"training script not found: {plan.script}")


def check_submittable(plan: LaunchPlan) -> None:
    """Everything that can refuse a submission without creating anything."""
    check_script(plan)
    get_scheduler(plan.profile.scheduler).check(plan)


def planned_run_dir(plan: LaunchPlan) -> Path:
    """The path a new run directory for ``plan`` gets (not created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", plan.job_name)[:40]
    return runs_root() / f"{stamp}-{safe_name}-{uuid.uuid4().hex[:6]}"


def snapshot_script(plan: LaunchPlan, run_dir: Path) -> LaunchPlan:
    """Copy the script's folder so later edits do not change a queued job (:mod:`.snapshot`)."""
    target = run_dir / SNAPSHOT_DIR
    snap = plan_snapshot(plan.script)
    copy_snapshot(snap, target, plan.profile.share_with_group)
    return replace(plan, script=str(target / snap.script))


def absolute_script(plan: LaunchPlan) -> LaunchPlan:
    return replace(plan, script=str(Path(plan.script).resolve()))


def dry_run(plan: LaunchPlan) -> Request:
    """The request ``submit`` would make for ``plan`` now, in the run directory it would create.

    It asks the cluster nothing (``Scheduler.check``: ``sinfo`` for Slurm), as ``render`` does not:
    a dry run is for looking at the batch script, also where the cluster is down or not reachable,
    and a failed ``sinfo`` made it exit 1. ``submit`` runs that check."""
    check_script(plan)
    check_runs_root()
    run_dir = planned_run_dir(plan)
    return get_scheduler(plan.profile.scheduler).dryrun(absolute_script(plan), run_dir, 0, sys.executable)


def start_estimate(plan: LaunchPlan) -> str | None:
    """When the scheduler would start ``plan`` now, asked without submitting (``submit
    --test-only``; printed by ``submit`` too): its one line, or None where jobs start at once."""
    from orchestrator.config.scheduler_kinds import scheduler_kind

    if not scheduler_kind(plan.profile.scheduler).has_queue:
        return None
    scheduler = get_scheduler(plan.profile.scheduler)
    scheduler.check(plan)
    return scheduler.start_estimate(dry_run(plan))


def _start_estimate_quietly(scheduler: Any, plan: LaunchPlan, request: Request) -> str | None:
    """The scheduler's start estimate for ``request``, asked just before submitting it (its ISO
    time), or None: no queue, or the scheduler would not say (the submission then tells)."""
    from orchestrator.config.scheduler_kinds import scheduler_kind

    if not scheduler_kind(plan.profile.scheduler).has_queue:
        return None
    try:
        said = scheduler.start_estimate(request)
    except (OrchestratorError, OSError):
        return None
    return start_estimates.estimate_of(said) if said else None


def plan_record(plan: LaunchPlan, run_dir: Path, resumed_from: str | None) -> dict[str, Any]:
    """The plan as the run directory keeps it: enough to re-submit by hand."""
    return {
        **plan.to_json(),
        "run_dir": str(run_dir),
        "python": sys.executable,
        "cwd": os.getcwd(),
        "submitted_at": time.time(),
        "command": accelerate_launch_command(NODE_CONFIG_PLACEHOLDER, plan.script, plan.script_args),
        "resumed_from": resumed_from,
    }


def _make_run_dir(run_dir: Path, share_with_group: bool) -> None:
    try:
        run_dir.mkdir(parents=True, mode=run_dir_mode(share_with_group))
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None


def submit(
    plan: LaunchPlan,
    *,
    snapshot: bool = False,
    registry: Registry | None = None,
    existing_run_dir: Path | None = None,
    resumed_from: str | None = None,
    request: Request | None = None,
    after_job: str | None = None,
) -> Submitted:
    """Validate, create the run directory, submit, record the job.

    ``existing_run_dir`` (resume) reuses a run directory: checkpoints and metrics continue there,
    attempt numbers go on from the last one; its lock is held throughout (re-entrant: a caller that
    checked the run under the lock keeps it). ``request``: one made by :func:`dry_run` for this very
    plan, submitted as it is. ``after_job``: the job may start only once that one has ended (a successor).
    """
    check_submittable(plan)
    if snapshot:
        plan_snapshot(plan.script)  # too large a folder is refused before anything is created
    share = plan.profile.share_with_group
    with umask(run_umask(share)):
        if existing_run_dir is not None:
            try:
                with run_lock(existing_run_dir, what="submit"):
                    return _submit_into(
                        plan, existing_run_dir, False, snapshot, registry, resumed_from, request, after_job
                    )
            except RunLocked as exc:
                raise UserError(f"{exc}; try again when it is done") from None
        check_runs_root()
        run_dir = request.run_dir if request is not None else planned_run_dir(plan)
        if registry is not None and not registry.has_local_ids():
            registry.seed_local_ids(highest_local_id(runs_root()))
        if registry is not None:
            # The intent first: a command killed at any point after this leaves nothing unknown
            # (the next command finishes or removes the run directory). Completed in _submit_into.
            job = _job_fields(plan, run_dir, resumed_from)
            registry.begin_submission(
                submission_token(run_dir, 0), run_dir, 0, True, plan.profile.scheduler, job
            )
        try:
            _make_run_dir(run_dir, share)
        except UserError as exc:
            if registry is not None:
                registry.end_submission(submission_token(run_dir, 0), "failed", note=str(exc))
            raise
        return _submit_into(plan, run_dir, True, snapshot, registry, resumed_from, request)


def _job_fields(plan: LaunchPlan, run_dir: Path, resumed_from: str | None) -> dict[str, Any]:
    """What the registry records of the job (``Registry.add_job`` keywords, and its start)."""
    return {
        "name": plan.job_name,
        "profile": plan.profile_name,
        "scheduler": plan.profile.scheduler,
        "strategy": plan.options.strategy,
        "nodes": plan.nodes,
        "procs_per_node": plan.procs_per_node,
        "command": [plan.script, *plan.script_args],
        "run_dir": str(run_dir),
        "max_requeues": plan.max_requeues,
        "resumed_from": resumed_from,
    }


def _record_job(
    registry: Registry,
    job_id: str,
    scheduler_job_id: str,
    attempt_base: int,
    job: dict[str, Any],
    source: str,
) -> None:
    fields = {k: v for k, v in job.items() if k != "resumed_from"}
    registry.add_job(job_id=job_id, source=source, **fields)
    registry.add_attempt(
        job_id,
        attempt=attempt_base,
        scheduler_job_id=scheduler_job_id,
        started_from_checkpoint=job.get("resumed_from"),
    )


def _submit_into(
    plan: LaunchPlan,
    run_dir: Path,
    new_run_dir: bool,
    snapshot: bool,
    registry: Registry | None,
    resumed_from: str | None,
    request: Request | None,
    after_job: str | None = None,
) -> Submitted:
    scheduler = get_scheduler(plan.profile.scheduler)
    attempt_base: int | None = None
    # A new run directory's submission was begun by submit(): end it whatever fails here.
    token: str | None = submission_token(run_dir, 0) if new_run_dir else None
    try:
        if new_run_dir:
            plan = snapshot_script(plan, run_dir) if snapshot else absolute_script(plan)
        else:
            plan = absolute_script(plan)
            scheduler.prepare_run_dir(registry, run_dir)
            (run_dir / CANCEL_MARKER).unlink(missing_ok=True)  # a resumed job starts a new outcome
        record = plan_record(plan, run_dir, resumed_from)
        attempt_base = reserve_attempt(run_dir, record)
        prepare_notify(run_dir, record)  # notify/: this run's events are sent (contract.notify)
        if (
            request is None
            or request.plan != plan
            or request.run_dir != run_dir
            or request.attempt_base != attempt_base
        ):
            request = scheduler.dryrun(plan, run_dir, attempt_base, sys.executable)
        if after_job is not None:
            request = replace(request, extra={**request.extra, "after_job": after_job})
        job = _job_fields(plan, run_dir, resumed_from)
        token = str(request.extra.get("token") or submission_token(run_dir, attempt_base))
        if registry is not None:
            registry.begin_submission(token, run_dir, attempt_base, new_run_dir, plan.profile.scheduler, job)
        estimate = _start_estimate_quietly(scheduler, plan, request) if after_job is None else None
        scheduled = scheduler.schedule(request, registry)
    except (OrchestratorError, OSError) as exc:
        # Nothing reached the scheduler (it refused, or we failed before asking): leave nothing.
        _undo(run_dir, new_run_dir, attempt_base)
        if registry is not None and token is not None:
            registry.end_submission(token, "failed", note=str(exc))
        if isinstance(exc, OSError):
            raise UserError(f"cannot write run directory {run_dir}: {exc.strerror or exc}") from None
        raise
    (run_dir / JOB_ID_FILE).write_text(scheduled.job_id)
    name_run(run_dir, scheduled.job_id)
    if estimate is not None:
        start_estimates.record(run_dir, scheduled.job_id, estimate)
    set_current_plan(run_dir, attempt_base)
    if registry is not None:
        _record_job(registry, scheduled.job_id, scheduled.scheduler_job_id, attempt_base, job, "submit")
        registry.end_submission(token, "submitted", job_id=scheduled.job_id)
    return Submitted(
        job_id=scheduled.job_id,
        run_dir=run_dir,
        scheduler=plan.profile.scheduler,
        submitit_job=scheduled.handle,
    )


def _undo(run_dir: Path, new_run_dir: bool, attempt_base: int | None) -> None:
    """Remove what a submission that never reached the scheduler made."""
    if new_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif attempt_base is not None and not attempt_dir(run_dir, attempt_base).exists():
        plan_file(run_dir, attempt_base).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- reconciling
def reconcile_pending(registry: Registry) -> list[str]:
    """Adopt or clean up submissions a killed command left open; the lines to show the user. One
    indexed lookup when nothing needs reconciling (what every command pays)."""
    if not registry.has_pending_submissions():
        return []
    return reconcile(registry)


def reconcile(registry: Registry) -> list[str]:
    """Close submissions a killed command left open; returns what was done, one line each.

    A submission whose command still runs is left alone. For the others the scheduler is asked, once
    per scheduler, which jobs carry their tokens: a job found is adopted into the registry (its run
    directory finished so it can run), or cancelled when it cannot be; a token no job carries means
    the scheduler never got the submission, and what it had made is removed.
    """
    from orchestrator.registry.submissions import ABANDONED, ADOPTED, CANCELLED, PENDING, SUBMITTED

    lines: list[str] = []
    stale = [i for i in registry.submissions(PENDING) if not i.submitter_alive()]
    by_scheduler: dict[str, list[SubmissionIntent]] = {}
    for intent in stale:
        by_scheduler.setdefault(intent.scheduler, []).append(intent)
    for name, intents in by_scheduler.items():
        scheduler = get_scheduler(name)
        found = scheduler.find_submitted([i.token for i in intents], min(i.created_at for i in intents))
        if found is None:
            continue  # the scheduler did not answer: try again next time
        for intent in intents:
            job_id = found.get(intent.token)
            if job_id is None:
                lines.append(_abandon(registry, intent, ABANDONED))
                continue
            try:
                registry.get(job_id)
                registry.end_submission(intent.token, SUBMITTED, job_id=job_id)
                continue  # recorded after all; only the closing was lost
            except UserError:
                pass
            lines.append(_adopt(registry, scheduler, intent, job_id, ADOPTED, CANCELLED))
    return lines


def _abandon(registry: Registry, intent: SubmissionIntent, state: str) -> str:
    run_dir = intent.run_dir
    keep = registry.run_at(run_dir) is not None or not intent.new_run_dir
    _undo(run_dir, not keep, intent.attempt_base)
    note = (
        f"a submission into {run_dir} (attempt {intent.attempt_base}) was interrupted before the scheduler "
        f"took it; {'its attempt plan was removed' if keep else 'its run directory was removed'}"
    )
    registry.end_submission(intent.token, state, note=note)
    return note


def _adopt(
    registry: Registry,
    scheduler: Scheduler,
    intent: SubmissionIntent,
    job_id: str,
    adopted: str,
    cancelled: str,
) -> str:
    run_dir = intent.run_dir
    problem = scheduler.adopt(run_dir, job_id) if run_dir.is_dir() else f"run directory {run_dir} is gone"
    if problem:
        scheduler.discard(job_id, f"orphaned submission: {problem}")
        note = f"cancelled job {job_id}: its submit was interrupted and it cannot run ({problem})"
        registry.end_submission(intent.token, cancelled, job_id=job_id, note=note)
        return note
    (run_dir / JOB_ID_FILE).write_text(job_id)
    name_run(run_dir, job_id)
    set_current_plan(run_dir, intent.attempt_base)
    _record_job(registry, job_id, job_id, intent.attempt_base, intent.job, "adopted")
    note = f"adopted job {job_id}: its submit was interrupted after the scheduler took it (run directory {run_dir})"
    registry.end_submission(intent.token, adopted, job_id=job_id, note=note)
    return note
