"""A new attempt of a job from its last complete checkpoint (``resume``, ``Job.resume``).

The new attempt shares the run directory (checkpoints, metrics, logs continue)
and may use another node count, strategy or profile, as long as the checkpoint
can be resharded into it: DCP sharded checkpoints load at any world size and
between FSDP1 and FSDP2, but a ddp checkpoint (a full model state dict) and an
FSDP one (sharded folders) are not interchangeable.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config.budget import parse_budget
from orchestrator.config.options import OPTIONS
from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import load_profile
from orchestrator.config.strategies import STRATEGIES
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from typing import TypedDict, Unpack  # Unpack: Python 3.11; read by the type checker only

    class ResumeOverrides(TypedDict, total=False):
        """What a resume may change (:func:`resume_plan`'s keywords; absent or None: as before),
        passed on by every resume entry point. mypy checks each forwarding call against
        ``resume_plan``'s signature."""

        nodes: int | None
        procs_per_node: int | None
        strategy: str | None
        profile: str | None
        profiles_dir: str | None
        budget: str | None


def resume_plan(
    previous: LaunchPlan,
    *,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    strategy: str | None = None,
    profile: str | None = None,
    profiles_dir: str | None = None,
    budget: str | None = None,
) -> LaunchPlan:
    """``previous`` again, with what the resume changes (None: as before). ``budget``: the run's new
    cap over all its attempts, earlier ones included (``resume --budget MORE``)."""
    from orchestrator.schedulers import get_scheduler

    if profile is not None:
        profile_name, _, cluster = load_profile(profile, profiles_dir)
    else:
        profile_name, cluster = previous.profile_name, previous.profile
    # Every option carries over as if typed again (so an FSDP-only one stays checked against a new
    # --strategy); the strategy is the one the command line may change.
    carried = {o.name: getattr(previous.options, o.name) for o in OPTIONS}
    if strategy:
        carried["strategy"] = strategy
    options = merge_options(cluster, **carried)
    return build_plan(
        profile_name,
        cluster,
        options,
        script=previous.script,
        script_args=previous.script_args,
        nodes=nodes or (previous.nodes if profile is None else None),
        procs_per_node=procs_per_node or (previous.procs_per_node if profile is None else None),
        job_name=previous.job_name,
        time_limit=previous.time_limit if profile is None else None,
        max_requeues=previous.max_requeues,
        # What earlier attempts learned about the cluster stays: a lost node is still excluded, and
        # --auto-resume still applies (the exclusions only where they name this cluster's nodes).
        auto_resume=previous.auto_resume and get_scheduler(cluster.scheduler).can_lose_nodes,
        exclude_nodes=previous.exclude_nodes if profile is None else (),
        hang_timeout=previous.hang_timeout if profile is None else None,
        budget=parse_budget(budget) if budget is not None else previous.budget,
    )


def check_resharding(checkpoint_strategy: str | None, new_strategy: str, step: int) -> None:
    """Refuse, before submitting, a resume whose training would refuse the checkpoint at its start.

    Another world size is not refused: DCP folders reshard, and a ZeRO checkpoint is converted to
    DeepSpeed's universal checkpoint by the resumed run (train/deepspeed_zero.py)."""
    if checkpoint_strategy is None or checkpoint_strategy not in STRATEGIES:
        return
    old_ds, new_ds = STRATEGIES[checkpoint_strategy].uses_deepspeed, STRATEGIES[new_strategy].uses_deepspeed
    if (old_ds or new_ds) and checkpoint_strategy != new_strategy:
        why = (
            "ZeRO partitions differ between stages; resume with the same stage"
            if old_ds and new_ds
            else "DeepSpeed ZeRO checkpoints and DDP/FSDP checkpoints are different formats"
        )
        raise UserError(
            f"--strategy {new_strategy}: the checkpoint at step {step} was written by {checkpoint_strategy}: "
            f"{why} (--strategy {checkpoint_strategy}); `orchestrator export` writes its weights for a new run"
        )
    old_fsdp = STRATEGIES[checkpoint_strategy].uses_fsdp
    new_fsdp = STRATEGIES[new_strategy].uses_fsdp
    if old_fsdp != new_fsdp:
        raise UserError(
            f"--strategy {new_strategy}: the checkpoint at step {step} was written by {checkpoint_strategy} "
            f"({'sharded DCP folders' if old_fsdp else 'a full model state dict'}), which "
            f"{'an FSDP' if new_fsdp else 'ddp'} run cannot load; resume with "
            f"{'an FSDP strategy' if old_fsdp else '--strategy ddp'}"
        )


def check_budget_left(asked: str, run_dir: Path, previous: LaunchPlan, plan: LaunchPlan) -> None:
    """Refuse a resume its budget would stop at once: one the budget stopped, with no more budget than
    it had, and one whose budget the run's earlier attempts have spent already."""
    from orchestrator.config.budget import in_budget_units
    from orchestrator.contract.budget_records import budget_stop, spent_hours
    from orchestrator.contract.run_dir import attempt_dirs

    if plan.budget is None:
        return
    last = max((a for a, _ in attempt_dirs(run_dir)), default=None)
    if (
        last is not None
        and budget_stop(run_dir, last) is not None
        and previous.budget is not None
        and plan.budget == previous.budget
    ):
        raise UserError(
            f"job {asked}: its budget {plan.budget} stopped it; give the run more: resume --budget MORE "
            f"(the new cap covers every attempt, this one's spending included)"
        )
    spent = in_budget_units(plan.budget, spent_hours(run_dir), plan.profile)
    if spent >= plan.budget.amount:
        raise UserError(
            f"job {asked}: --budget {plan.budget}: the run has spent {plan.budget.show(spent)} already; "
            f"the budget covers every attempt of the run: give more than that"
        )


def refuse_while_run_is_live(registry: Any, job_id: str) -> None:
    """A second job training in the same run directory would interleave checkpoints and metrics: the
    run's newest job (this one, or the one its run went on in) must be over first. A run that
    completed has nothing left to train. Called under the run's lock, so no other resume can submit
    between this check and this one's submission."""
    from orchestrator.contract import run_alive
    from orchestrator.contract.job_states import JobState
    from orchestrator.runner.refresh import refresh_states

    newest = registry.run_of(job_id).newest_job_id
    record = registry.get(newest)
    st = refresh_states(registry, [record]).states.get(newest)
    state = st.state if st is not None else record.last_state
    if state is JobState.COMPLETED:
        which = f"job {job_id}" if newest == job_id else f"job {job_id}'s run (continued as job {newest})"
        raise UserError(f"{which} COMPLETED: its training finished, there is nothing to resume")
    living = run_alive.holders(record.run_dir)
    if not state.is_terminal():
        which = (
            f"job {job_id}" if newest == job_id else f"job {job_id}'s run continues as job {newest}, which"
        )
        pids = f" (pid {', '.join(map(str, living))} of its run still runs)" if living else ""
        raise UserError(
            f"{which} is {state.value}{pids}; a resume now would train a second job in the same run "
            f"directory. Wait for it to end, or cancel it first (orchestrator cancel {newest})"
        )
    if living is not None:
        # Whatever any scheduler says: a process of the run (an orphaned rank, say) still trains.
        who = f"pid {', '.join(map(str, living))}" if living else "a process on another host"
        raise UserError(
            f"job {job_id}: {who} of its run still runs in {record.run_dir}; a resume now would train "
            f"twice in one run directory. Wait for it to end, or cancel it (orchestrator cancel {newest})"
        )


def resume_job(
    registry: Any,
    job_id: str,
    **overrides: Unpack[ResumeOverrides],
) -> tuple[str, list[str]]:
    """The resume itself: checks and submission under the run's lock; the new job's id and the
    lines to print."""
    from orchestrator.rundir.lock import RunLocked, run_lock
    from orchestrator.runner.submission import reconcile_pending

    for line in reconcile_pending(registry):
        print(line, file=sys.stderr)
    job = registry.get(job_id)
    run_dir = Path(job.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"job {job_id}: run directory {run_dir} no longer exists")
    # The check and the submission under one lock: two resumes of one job started together submit once.
    try:
        with run_lock(run_dir, what=f"resume {job_id}"):
            return _resume_locked(registry, job_id, job.job_id, run_dir, overrides)
    except RunLocked as exc:
        raise UserError(f"job {job_id}: {exc}; try again when it is done") from None


def _resume_locked(
    registry: Any, asked: str, job_id: str, run_dir: Path, changes: ResumeOverrides
) -> tuple[str, list[str]]:
    from orchestrator.contract.run_dir import JOB_FILE, last_complete_checkpoint, read_current_plan_json
    from orchestrator.runner.submission import submit

    refuse_while_run_is_live(registry, job_id)
    data = read_current_plan_json(run_dir)
    if not data:
        raise UserError(f"job {asked}: {run_dir / JOB_FILE} is missing or unreadable")
    previous = LaunchPlan.from_json(data)
    checkpoint = last_complete_checkpoint(run_dir)
    if checkpoint is None:
        from orchestrator.contract.run_dir import hook_checkpoint_dirs

        where = ", ".join(str(d) for d in [run_dir / "checkpoints", *hook_checkpoint_dirs(run_dir)])
        raise UserError(f"job {asked}: no complete checkpoint of this run in {where}; nothing to resume from")
    plan = resume_plan(previous, **changes)
    check_resharding(checkpoint.strategy, plan.options.strategy, checkpoint.step)
    check_budget_left(asked, run_dir, previous, plan)
    submitted = submit(plan, registry=registry, existing_run_dir=run_dir, resumed_from=str(checkpoint.path))
    lines = [
        f"resuming job {asked} from step {checkpoint.step} ({checkpoint.path.name})",
        f"submitted job {submitted.job_id}",
        f"run directory {run_dir}",
    ]
    if checkpoint.world_size and checkpoint.world_size != plan.world_size:
        zero = STRATEGIES[plan.options.strategy].uses_deepspeed
        lines.append(
            f"resharding: checkpoint world size {checkpoint.world_size} -> {plan.world_size}"
            + (" (ZeRO: the new attempt converts it to DeepSpeed's universal checkpoint)" if zero else "")
        )
    return submitted.job_id, lines
