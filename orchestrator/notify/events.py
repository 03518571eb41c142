"""Notifications of a run's events (a profile's ``notify:``): which events a run has, and where
they go.

The run's owner (its supervising process: the Slurm batch step, a local job's node 0) derives each
event from the run directory as it changes (:func:`attempt_events`, :func:`end_event`), records it
once by its key (``started``, ``requeued.attempt_2``, ``end.<job id>``...) and sends it, in order and
durably (:mod:`orchestrator.notify.outbox`). ``status``, ``wait`` and the dashboard never send or
claim one: a shell without the secret, or a command that must not wait on a receiver, has no part in
it.

The webhook URL is a secret: the profile names an environment variable or a file, read at send time,
where the job runs (the job has it because its submission had it). The URL is written nowhere.
Standard library only: the batch step imports it without anything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.restarts import read_restarts
from orchestrator.contract.run_dir import (
    ATTEMPT_START_FILE,
    HANG_REPORT_FILE,
    NOTIFY_DIR,
    attempt_dir,
    attempt_dirs,
    hang_dir,
    plan_file,
    read_json,
)


@dataclass(frozen=True)
class Target:
    """Where events go: a profile's ``notify:`` values (the names of the secret, not the secret)."""

    webhook_env: str | None = None
    webhook_file: str | None = None
    command: str | None = None
    timeout_s: float = 60.0

    @classmethod
    def from_profile(cls, notify: Any) -> Target | None:
        """From ``profile.notify`` as a plan records it (a dict); None when nothing is configured."""
        if not isinstance(notify, dict):
            return None
        target = cls(
            webhook_env=notify.get("webhook_env") or None,
            webhook_file=notify.get("webhook_file") or None,
            command=notify.get("command") or None,
            timeout_s=float(notify.get("timeout_s") or 60),
        )
        return target if target.webhook_env or target.webhook_file or target.command else None

    @classmethod
    def of_run(cls, run_dir: Path) -> Target | None:
        """The target of the run's current plan (``job.json``)."""
        from orchestrator.contract.run_dir import read_current_plan_json

        profile = read_current_plan_json(run_dir).get("profile")
        return cls.from_profile(profile.get("notify") if isinstance(profile, dict) else None)

    def webhook_url(self) -> tuple[str | None, str | None]:
        """``(url, None)`` or ``(None, why not)``, read now: from the environment or the file."""
        if self.webhook_env:
            url = os.environ.get(self.webhook_env, "").strip()
            if url:
                return url, None
            if not self.webhook_file:
                return None, f"the environment variable {self.webhook_env} is not set here"
        if self.webhook_file:
            path = Path(os.path.expanduser(self.webhook_file))
            try:
                url = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                return None, f"cannot read the webhook file {path}: {exc.strerror or type(exc).__name__}"
            return (url, None) if url else (None, f"the webhook file {path} is empty")
        return None, None


@dataclass(frozen=True)
class Event:
    """One thing that happened to a run; ``key`` is unique within the run directory."""

    key: str
    kind: str
    text: str
    details: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        return {"event": self.kind, "key": self.key, "text": self.text, **self.details}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Event:
        details = {k: v for k, v in payload.items() if k not in ("event", "key", "text")}
        return cls(str(payload["key"]), str(payload["event"]), str(payload["text"]), details)


# ------------------------------------------------------------------------------- the events
def _name(run_dir: Path) -> str:
    from orchestrator.contract.run_dir import read_current_plan_json

    return str(read_current_plan_json(run_dir).get("job_name") or Path(run_dir).name)


def attempt_events(
    run_dir: Path,
    attempt: int,
    first: int,
    job_id: str,
    name: str | None = None,
    restarts: list[dict[str, Any]] | None = None,
) -> list[Event]:
    """What attempt ``attempt`` of a run (first attempt ``first``) says about itself so far: it
    started (the run's first), was restarted inside its allocation (``restarts.jsonl``), came back as
    the same job (a requeue) or as another one (a new submission began at it:
    ``job.attempt_<A>.json``), resumed from a step, or hung."""
    run_dir = Path(run_dir)
    name = name or _name(run_dir)
    base = {"run_dir": str(run_dir), "name": name, "job_id": job_id, "attempt": attempt}
    out: list[Event] = []
    if attempt <= first:
        out.append(Event("started", "started", f"{name}: job {job_id} started", base))
    elif restart := next(
        (
            r
            for r in (read_restarts(run_dir) if restarts is None else restarts)
            if r.get("attempt") == attempt
        ),
        None,
    ):
        cause = str(restart.get("cause") or "a fault")
        out.append(
            Event(
                f"restarted.attempt_{attempt}",
                "restarted",
                f"{name}: job {job_id} restarted in its allocation (attempt {attempt}): {cause}",
                {**base, "cause": cause, "step": restart.get("step")},
            )
        )
    elif plan_file(run_dir, attempt).exists():
        out.append(
            Event(
                f"continued.attempt_{attempt}",
                "continued",
                f"{name}: continued as job {job_id} (attempt {attempt})",
                base,
            )
        )
    else:
        out.append(
            Event(
                f"requeued.attempt_{attempt}",
                "requeued",
                f"{name}: job {job_id} requeued (attempt {attempt})",
                base,
            )
        )
    start = read_json(attempt_dir(run_dir, attempt) / ATTEMPT_START_FILE) or {}
    step = start.get("step")
    if start.get("checkpoint") and isinstance(step, int) and step > 0:
        out.append(
            Event(
                f"resumed.attempt_{attempt}",
                "resumed",
                f"{name}: job {job_id} resumed from step {step} (attempt {attempt})",
                {**base, "step": step},
            )
        )
    out.extend(budget_events(run_dir, job_id, name))
    hang = read_json(hang_dir(run_dir, attempt) / HANG_REPORT_FILE)
    if hang is not None:
        reason = str(hang.get("reason") or "the hang watchdog fired")
        out.append(
            Event(
                f"hang.attempt_{attempt}",
                "hang",
                f"{name}: job {job_id} hang detected: {reason}",
                {**base, "reason": reason, "rank": hang.get("culprit_rank")},
            )
        )
    return out


#: The share of a run's budget at which its owner says so, once per budget (``resume --budget MORE``
#: gives a new one).
BUDGET_WARN_AT = 0.8


def budget_events(run_dir: Path, job_id: str, name: str) -> list[Event]:
    """``budget``: the run has spent :data:`BUDGET_WARN_AT` of its budget (its attempts' meters)."""
    from orchestrator.contract.budget_records import spent_hours
    from orchestrator.contract.run_dir import read_current_plan_json

    text = read_current_plan_json(run_dir).get("budget")
    if not isinstance(text, str):
        return []
    from orchestrator.config.budget import parse_budget
    from orchestrator.contract.errors import UserError

    try:
        budget = parse_budget(text)
    except UserError:
        return []
    profile = read_current_plan_json(run_dir).get("profile")
    spent = spent_hours(run_dir)
    if budget.is_money and isinstance(profile, dict):
        key = "price_per_gpu_hour" if profile.get("gpus_per_node") else "price_per_cpu_hour"
        price = profile.get(key)
        spent *= float(price) if isinstance(price, int | float) else 0.0
    if spent < BUDGET_WARN_AT * budget.amount:
        return []
    share = f"{100 * BUDGET_WARN_AT:.0f} %"
    return [
        Event(
            f"budget_{share[:-2]}.{budget}",
            "budget",
            f"{name}: job {job_id} has spent {share} of its budget ({budget.show(spent)} of {budget})",
            {"run_dir": str(run_dir), "name": name, "job_id": job_id, "budget": str(budget), "spent": spent},
        )
    ]


def run_dir_events(run_dir: Path, job_id: str) -> list[Event]:
    """Every attempt's events (:func:`attempt_events`) as the run directory says them now."""
    attempts = [a for a, _ in attempt_dirs(Path(run_dir))]
    if not attempts:
        return []
    name = _name(Path(run_dir))
    restarts = read_restarts(Path(run_dir))  # once, not once per attempt
    return [e for a in attempts for e in attempt_events(run_dir, a, attempts[0], job_id, name, restarts)]


def end_event(
    run_dir: Path, job_id: str, state: str, reason: str | None, name: str | None = None
) -> Event | None:
    """A job's end: ``completed``; ``preempted`` (it checkpointed on a stop signal and waits for
    ``orchestrator resume``); or ``failed`` with the one-line reason ``status`` gives. A cancelled
    job (the user's own doing) and a job still running have none."""
    name = name or _name(Path(run_dir))
    details = {"run_dir": str(run_dir), "name": name, "job_id": job_id, "state": state}
    if state == "COMPLETED":
        return Event(f"end.{job_id}", "completed", f"{name}: job {job_id} completed", details)
    if state == "PREEMPTED":
        why = reason or "checkpointed on a stop signal and stopped"
        return Event(
            f"end.{job_id}",
            "preempted",
            f"{name}: job {job_id} preempted ({why}); `orchestrator resume {job_id}` continues it",
            {**details, "reason": why},
        )
    if state == "BUDGET":
        why = reason or "its budget stopped it at a checkpoint"
        return Event(
            f"end.{job_id}",
            "budget",
            f"{name}: job {job_id} stopped by its budget ({why}); "
            f"`orchestrator resume {job_id} --budget MORE` continues it",
            {**details, "reason": why},
        )
    if state in ("FAILED", "OUT_OF_MEMORY", "NODE_FAIL", "TIMEOUT", "BOOT_FAIL", "DEADLINE"):
        why = reason or state
        return Event(
            f"end.{job_id}", "failed", f"{name}: job {job_id} {state}: {why}", {**details, "reason": why}
        )
    return None


def sweep_event(sweep_dir: Path, sweep_id: str, outcome: str, best: str | None) -> Event:
    """A sweep whose every task ended, naming its best task."""
    best_text = f"; best task: {best}" if best else ""
    return Event(
        "sweep_finished",
        "sweep_finished",
        f"sweep {sweep_id} finished {outcome}{best_text}",
        {"run_dir": str(sweep_dir), "sweep_id": sweep_id, "outcome": outcome, "best": best},
    )


# ------------------------------------------------------------------------------- the folder
def enabled(run_dir: str | Path) -> bool:
    """Whether the run sends notifications: its submission made ``notify/`` (one stat)."""
    return os.path.isdir(os.path.join(run_dir, NOTIFY_DIR))


def prepare(run_dir: Path, plan: dict[str, Any]) -> None:
    """At submission: make ``notify/`` when the plan's profile has a target (see :func:`enabled`)."""
    profile = plan.get("profile")
    if isinstance(profile, dict) and Target.from_profile(profile.get("notify")) is not None:
        (Path(run_dir) / NOTIFY_DIR).mkdir(mode=0o700, exist_ok=True)
