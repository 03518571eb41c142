"""Status rows: scheduler state and training progress of many jobs at once.

One batched scheduler query for every job (see :mod:`orchestrator.runner.refresh`), progress from
the tail of each run's metrics.jsonl (through the summary cache). When the scheduler cannot be
asked, the registry's last known state is shown with a ``(stale)`` marker instead of failing or
hanging. ``status``, ``status SWEEP``, ``Job.status`` and ``Sweep.status`` share these rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from orchestrator.contract.attempt_start import NO_HOOK, describe_newest_start
from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import JobRecord, Registry
from orchestrator.rundir.summary import RunSummary
from orchestrator.rundir.summary_cache import SUMMARY_CACHE_FILE, SummaryCache
from orchestrator.runner.dependencies import PREFIXES as DEPENDENCY_PREFIXES
from orchestrator.runner.dependencies import explain as explain_dependency
from orchestrator.runner.refresh import refresh_states
from orchestrator.schedulers import get_scheduler
from orchestrator.schedulers.query import QueryResult

#: ``status`` with no ids shows every non-terminal job plus those active within this window.
RECENT_S = 24 * 3600.0


@dataclass(frozen=True)
class StatusRow:
    """One job's line in the status table (and one object in ``--json``)."""

    job_id: str
    name: str
    scheduler: str
    state: JobState
    raw_state: str
    stale: bool
    source: str
    strategy: str
    nodes: int
    procs_per_node: int
    step: int | None
    max_steps: int | None
    loss: float | None
    val_loss: float | None
    tokens_per_s: float | None
    eta_s: float | None
    checkpoint_step: int | None
    corrupt_checkpoints: list[int]
    checkpoint_path: str | None
    requeues: int
    resumes: int
    reason: str | None
    node_list: str | None
    exit_code: str | None
    run_dir: str
    continued_as: str | None = None
    """The job this run went on in (``resume`` / ``--auto-resume``), the last of a chain."""
    run_state: JobState | None = None
    """State of ``continued_as`` when there is one: what became of the run, not of this job."""
    started_from: str | None = None
    """How the newest attempt of a requeued or resumed run started: resumed at step k from a checkpoint,
    or restarted from step 0 (the script has no checkpoint hook): never a resume that did not happen."""
    liveness: dict[str, Any] | None = None
    """Running jobs: seconds since any rank's last output, the slowest rank (orchestrator.rundir.liveness)."""
    restarts: tuple[dict[str, Any], ...] = ()
    """Restarts inside the job's allocation (``restarts.jsonl``): each one's cause, attempt and step."""
    start_estimate: str | None = None
    """A pending job: when the scheduler expects to start it (Slurm's backfill estimate), if it has one."""
    budget: str | None = None
    """The run's ``--budget``; ``budget_spent``: what its attempts have spent of it, in its unit."""
    budget_spent: float | None = None

    @property
    def state_detail(self) -> str | None:
        """The scheduler's own word for the state where it says more than ``state`` (``COMPLETING``
        for RUNNING), from a live answer; None otherwise."""
        if (
            self.raw_state
            and self.source != "registry"
            and get_scheduler(self.scheduler).normalize_state(self.raw_state) != self.state.value
        ):
            return self.raw_state
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "name": self.name,
            "scheduler": self.scheduler,
            "state": self.state.value,
            "raw_state": self.raw_state,
            "terminal": self.state.is_terminal(),
            "stale": self.stale,
            "source": self.source,
            "strategy": self.strategy,
            "nodes": self.nodes,
            "procs_per_node": self.procs_per_node,
            "step": self.step,
            "max_steps": self.max_steps,
            "loss": self.loss,
            "val_loss": self.val_loss,
            "tokens_per_s": self.tokens_per_s,
            "eta_s": self.eta_s,
            "checkpoint_step": self.checkpoint_step,
            "corrupt_checkpoints": list(self.corrupt_checkpoints),
            "checkpoint_path": self.checkpoint_path,
            "requeues": self.requeues,
            "restarts": len(self.restarts),
            "restart_causes": [r.get("cause") for r in self.restarts],
            "resumes": self.resumes,
            "reason": self.reason,
            "node_list": self.node_list,
            "exit_code": self.exit_code,
            "run_dir": self.run_dir,
            "continued_as": self.continued_as,
            "run_state": (self.run_state or self.state).value,
            "started_from": self.started_from,
            "liveness": self.liveness,
            "start_estimate": self.start_estimate,
            "budget": self.budget,
            "budget_spent": self.budget_spent,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StatusRow:
        """The row :meth:`to_json` wrote (a login host's ``status --json``); of its restarts, their
        causes (the JSON's ``restart_causes``)."""
        names = {f.name for f in fields(cls)} - {"state", "run_state", "restarts", "corrupt_checkpoints"}
        given: dict[str, Any] = {k: data.get(k) for k in names}
        return cls(
            **given,
            state=JobState(data["state"]),
            run_state=JobState(data["run_state"]) if data.get("run_state") else None,
            restarts=tuple({"cause": c} for c in data.get("restart_causes") or ()),
            corrupt_checkpoints=list(data.get("corrupt_checkpoints") or ()),
        )


def _row(
    job: JobRecord,
    result: QueryResult,
    summary: RunSummary,
    attempts_recorded: int,
    successor: JobRecord | None,
    cache: SummaryCache,
) -> StatusRow:
    st = result.states.get(job.job_id)
    own_state = st.state if st else job.last_state
    stopped_by_budget = _budget_stop(job, own_state, summary)
    if stopped_by_budget is not None:
        own_state = JobState.BUDGET  # the scheduler's word for it (Slurm: FAILED) says less
    run_state: JobState | None = None
    if successor is not None:
        succ_st = result.states.get(successor.job_id)
        run_state = succ_st.state if succ_st else successor.last_state
    restarts: tuple[dict[str, Any], ...] = ()
    if summary.attempts > 1:
        from orchestrator.contract.restarts import read_restarts

        restarts = tuple(r for r in read_restarts(job.run_dir) if r.get("job_id") == job.job_id)
    # The registry records every attempt of the job: Slurm's requeues and restarts in its allocation.
    requeues = max(attempts_recorded - 1 - len(restarts), 0)
    if summary.attempts - 1 - len(restarts) > requeues and successor is None:
        # The run directory has more attempts than this job recorded: requeues the registry never
        # heard of (the node could not reach it), or earlier jobs of the run (`resume`), which are
        # not this job's requeues. Count only the attempts since this job's own submission.
        requeues = max(requeues_since_last_submission(job.run_dir) - len(restarts), 0)
    ckpt = summary.checkpoint
    started_from = describe_newest_start(job.run_dir) if summary.attempts > 1 else None
    # Built without StatusRow's generated __init__ (24 fields, each set via object.__setattr__ in a
    # frozen dataclass): ~1,000 rows per `status` call. Same fields, same values.
    row = StatusRow.__new__(StatusRow)
    row.__dict__.update(
        job_id=job.job_id,
        name=job.name,
        scheduler=job.scheduler,
        state=own_state,
        raw_state=st.raw_state if st else job.last_state.value,
        stale=st.stale if st else True,
        source=st.source if st else "registry",
        strategy=summary.strategy or job.strategy,
        nodes=job.nodes,
        procs_per_node=job.procs_per_node,
        step=summary.step,
        max_steps=summary.max_steps,
        loss=summary.loss,
        val_loss=summary.val_loss,
        tokens_per_s=summary.tokens_per_s,
        eta_s=summary.eta_s if not (run_state or own_state).is_terminal() else None,
        checkpoint_step=ckpt.step if ckpt else None,
        corrupt_checkpoints=summary.corrupt_checkpoints,
        checkpoint_path=str(ckpt.path) if ckpt else None,
        requeues=requeues,
        resumes=summary.resumes,
        # Our own account of how a job ended ("node(s) n2 lost; auto-resumed as job 4") says more than
        # Slurm's ("NonZeroExitCode"), so it wins once the job is over.
        reason=stopped_by_budget
        or explain_dependency(
            job.run_dir,
            job.end_reason
            if job.end_reason and own_state.is_terminal()
            else (st.reason if st and st.reason else job.reason or job.end_reason),
            own_state.is_terminal(),
            own_state is JobState.CANCELLED,
        ),
        node_list=(st.node_list if st and st.node_list else job.node_list),
        exit_code=(st.exit_code if st and st.exit_code else job.exit_code),
        run_dir=str(job.run_dir),
        continued_as=successor.job_id if successor is not None else None,
        run_state=run_state,
        started_from=started_from,
        liveness=None if own_state.is_terminal() else cache.liveness(job.run_dir),
        restarts=restarts,
        start_estimate=st.start if st is not None and own_state is JobState.PENDING and st.start else None,
        budget=summary.budget,
        budget_spent=summary.budget_spent,
    )
    return row


def _budget_stop(job: JobRecord, state: JobState, summary: RunSummary) -> str | None:
    """The reason a run's budget stopped this job (``budget_stop.json`` names it), once it has ended
    other than COMPLETED; None otherwise."""
    if summary.budget is None or not state.is_terminal() or state in (JobState.COMPLETED, JobState.BUDGET):
        return None  # a local job records BUDGET itself, with the step it stopped at
    from orchestrator.contract.budget_records import budget_stop

    marker = budget_stop(job.run_dir)
    if marker is None or marker.get("job_id") != job.job_id:
        return None
    return f"{marker.get('reason') or 'budget'}; continue with resume --budget MORE"


def requeues_since_last_submission(run_dir: Any) -> int:
    """Attempts after the newest submission's first one (``job.attempt_<A>.json`` marks where each
    submission started): Slurm requeues of the run's current job, never earlier jobs' attempts."""
    import re
    from pathlib import Path

    from orchestrator.contract.run_dir import attempt_dirs

    attempts = [a for a, _ in attempt_dirs(Path(run_dir))]
    if not attempts:
        return 0
    try:
        names = [entry.name for entry in Path(run_dir).iterdir()]
    except OSError:
        return max(len(attempts) - 1, 0)
    bases = [int(m.group(1)) for n in names if (m := re.match(r"^job\.attempt_(\d+)\.json$", n))]
    newest = max(attempts)
    base = max((b for b in bases if b <= newest), default=min(attempts))
    return sum(1 for a in attempts if a > base)


def collect_status(
    registry: Registry, jobs: Sequence[JobRecord], timeout_s: float = 5.0
) -> tuple[list[StatusRow], QueryResult]:
    """Refresh states (one batched scheduler query), summarise run dirs, build rows in job order."""
    # A job whose run went on as another job (resume, auto-resume) is shown with that job's state too;
    # the successors join the same batched query, so it stays one scheduler call.
    successor_ids = registry.successors([j.job_id for j in jobs])
    asked = {j.job_id for j in jobs}
    extra = registry.get_many(dict.fromkeys(s for s in successor_ids.values() if s not in asked))
    by_id = {j.job_id: j for j in (*jobs, *extra)}
    result = refresh_states(registry, [*jobs, *extra], timeout_s=timeout_s)
    fresh = {k: st.state.value for k, st in result.states.items() if not st.stale}
    # Only a job that has ended and has no account yet can be explained (the failure report's reader
    # and its regexes are not imported for a thousand running jobs).
    unexplained = [
        j
        for j in jobs
        if not j.end_reason and j.job_id in fresh and result.states[j.job_id].state.is_terminal()
    ]
    explained: dict[str, str] = {}
    if unexplained:
        from orchestrator.runner.failure_reasons import record_explanations

        explained = record_explanations(registry, unexplained, fresh)
    if explained:
        jobs = [replace(j, end_reason=explained[j.job_id]) if j.job_id in explained else j for j in jobs]
    counts = registry.attempt_counts([j.job_id for j in jobs])
    # Unchanged run directories come from the summary cache next to the registry (a few stats
    # each instead of reading job.json, metrics.jsonl, checkpoints and logs again).
    cache = SummaryCache(registry.path.parent / SUMMARY_CACHE_FILE)
    rows = [
        _row(
            j,
            result,
            cache.summarize(j.run_dir),
            counts.get(j.job_id, 0),
            by_id.get(successor_ids.get(j.job_id, "")),
            cache,
        )
        for j in jobs
    ]
    cache.save()
    # A run that trained again from step 0 says so where it ends, too (`list`, `wait`, the registry);
    # not a budget's stop, which says why it ended (one that came while the attempt was starting left
    # no start record, as a script without a hook leaves none).
    explained_now = {j.job_id for j in jobs if not j.end_reason}
    for i, row in enumerate(rows):
        if (
            row.job_id in explained_now
            and row.state.is_terminal()
            and row.state is not JobState.BUDGET
            and row.started_from == NO_HOOK
        ):
            registry.set_end_reason(row.job_id, NO_HOOK)
            rows[i] = replace(row, reason=NO_HOOK)
    return rows, result


def failure_lines(rows: Sequence[StatusRow]) -> list[str]:
    """Under the table: why each failed job ended, with the command that shows the failing rank's log,
    and which checkpoints a restore skipped as corrupt."""
    from orchestrator.runner.failure_reasons import EXPLAINED_STATES

    lines = [
        f"{row.job_id} {row.state.value}: {row.reason}"
        for row in rows
        if row.reason and row.state.value in EXPLAINED_STATES and row.state.is_terminal()
    ]
    lines.extend(
        f"{row.job_id} {row.state.value}: {row.reason}"
        for row in rows
        if row.reason and row.reason.startswith(DEPENDENCY_PREFIXES)
    )
    lines.extend(
        f"{row.job_id} PENDING ({row.reason or 'waiting'}): the scheduler expects it to start at {row.start_estimate}"
        for row in rows
        if row.start_estimate and row.state is JobState.PENDING
    )
    for row in rows:
        if row.state is JobState.BUDGET:
            lines.append(f"{row.job_id} BUDGET: {row.reason}")
        elif row.budget is not None and row.budget_spent is not None:
            lines.append(f"{row.job_id}: budget: spent {_budget_words(row.budget, row.budget_spent)}")
        if row.restarts:
            last = row.restarts[-1]
            # The record's step is the newest complete shared checkpoint when the restart was decided;
            # where the attempt really resumed (memory checkpoints too) is the next line's.
            lines.append(
                f"{row.job_id}: restarted {len(row.restarts)} time(s) in its allocation; last as attempt "
                f"{last.get('attempt', '-')} (newest complete checkpoint then: step {last.get('step', '-')}): "
                f"{last.get('cause')}"
            )
        if row.started_from:
            lines.append(f"{row.job_id}: newest attempt {row.started_from}")
        if row.corrupt_checkpoints:
            steps = ", ".join(str(s) for s in row.corrupt_checkpoints)
            lines.append(
                f"{row.job_id}: checkpoint(s) at step {steps} skipped: their content did not match COMPLETE.json "
                f"(resumed from step {row.checkpoint_step if row.checkpoint_step is not None else '-'})"
            )
    return lines


def _budget_words(budget: str, spent: float) -> str:
    from orchestrator.config.budget import parse_budget

    cap = parse_budget(budget)
    return f"{cap.show(spent)} of {cap} ({100 * spent / cap.amount:.0f} %)"


def stale_note(result: QueryResult) -> str | None:
    """One line explaining a ``(stale)`` marker, or None when everything is live."""
    if not result.stale:
        return None
    why = "; ".join(result.errors) if result.errors else "the scheduler no longer knows some jobs"
    return f"(stale): showing the registry's last known state -- {why}"


def status_json(rows: Sequence[StatusRow], result: QueryResult) -> dict[str, Any]:
    return {
        "source": result.source,
        "stale": result.stale,
        "errors": list(result.errors),
        "scheduler_calls": dict(result.calls),
        "jobs": [r.to_json() for r in rows],
    }


def select_jobs(registry: Registry, ids: Sequence[str]) -> list[JobRecord]:
    """The jobs asked for, in order; none asked: every active job and those active recently."""
    if ids:
        return registry.get_many(dict.fromkeys(ids))
    return registry.active_and_recent(RECENT_S)


@dataclass(frozen=True)
class StatusReport:
    """``status``'s answer: a row per job, and the scheduler query they came from."""

    rows: list[StatusRow]
    result: QueryResult

    def failure_lines(self) -> list[str]:
        return failure_lines(self.rows)

    def liveness_lines(self) -> list[str]:
        """Running jobs silent for long, and their slowest rank (orchestrator.rundir.liveness)."""
        from orchestrator.rundir.liveness import liveness_lines

        return liveness_lines([(r.job_id, r.liveness) for r in self.rows])

    def stale_note(self) -> str | None:
        return stale_note(self.result)

    def to_json(self) -> dict[str, Any]:
        return status_json(self.rows, self.result)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StatusReport:
        """The report :meth:`to_json` wrote (a login host's ``status --json``); no per-job states."""
        result = QueryResult(
            states={}, source=str(data["source"]), stale=bool(data["stale"]),
            errors=tuple(data.get("errors") or ()), calls=dict(data.get("scheduler_calls") or {}),
        )  # fmt: skip
        return cls([StatusRow.from_json(row) for row in data["jobs"]], result)

    def all_ended(self) -> bool:
        """Every shown run is over (a run continued as another job answers for that job)."""
        return all((r.run_state or r.state).is_terminal() for r in self.rows)

    def all_completed(self) -> bool:
        return all((r.run_state or r.state).is_success() for r in self.rows)
