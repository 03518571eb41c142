"""The batch script's training step: ``srun`` under a supervisor that does not wait for a dead node.

``exec python -m orchestrator.schedulers.slurm.batch_step [--auto-resume] -- srun ...`` is the last line of every
sbatch script. Why a supervisor instead of a bare ``srun``: when a whole node dies, the tasks on
the other nodes fail within seconds (a broken collective), ``--kill-on-bad-exit`` ends them, and
then srun waits for the dead node's tasks to report, which they never do. It returns only once
slurmctld declares the node DOWN (``SlurmdTimeout``: 20 s on the test cluster, 300 s by default),
and Slurm then ends the job NODE_FAIL. Measured on the test cluster: first task failure 1-3 s
after the kill, srun back 26 s after it.

So the supervisor reads srun's own error lines (``srun: error: n1: task 0: Exited with exit code
1``); when a task has failed and srun is still there ``GRACE_S`` later, it probes every node of the
allocation (:mod:`orchestrator.schedulers.slurm.auto_resume`). A lost node ends the step at once; with
``--auto-resume`` a new attempt without it is submitted from the last complete checkpoint.

Signals: Slurm sends SIGTERM (cancel, preemption) to every process of the batch step, srun
included, and srun forwards it to the tasks. The supervisor survives it (a no-op handler, reset to
the default at exec, so srun's own disposition is untouched) and reports srun's status.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.contract.env import RESTART_IN_PLACE_ENV, RUN_DIR_ENV
from orchestrator.contract.in_place import ended_in_place, tell_nodes
from orchestrator.schedulers.base import record_attempt, record_restart
from orchestrator.schedulers.slurm import in_place
from orchestrator.schedulers.slurm.clear_memory import clear_memory_on
from orchestrator.schedulers.slurm.environment import (
    STEP_ATTEMPT_ENV,
    allocation_nodes,
    batch_job_id,
    batch_restarts,
    srun_on_every_node,
)
from orchestrator.schedulers.slurm.spares import Placement, placement_of

#: After the first failed task, how long srun may take to end the step by itself. With
#: ``--kill-on-bad-exit`` and live nodes it ends within about a second; measured 1-3 s.
GRACE_S = 5.0
#: srun's line for a task that ended badly, e.g. ``srun: error: n1: task 0: Exited with exit code 1``
#: or ``srun: error: n2: tasks 2-3: Killed``.
TASK_FAILURE_RE = re.compile(rb"srun: error: (\S+): tasks? [0-9,-]+: ")
#: Signals the supervisor must outlive (srun receives them from Slurm directly).
SURVIVED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def say(line: str) -> None:
    print(f"[orchestrator step] {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


class StepWatch:
    """srun as a child; its stderr copied through while noting the first task failure."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.first_failure_at: float | None = None
        self.failed_line = ""
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
        self._reader = threading.Thread(target=self._copy_stderr, daemon=True)
        self._reader.start()

    def _copy_stderr(self) -> None:
        assert self.proc.stderr is not None
        out = sys.stderr.buffer
        for line in iter(self.proc.stderr.readline, b""):
            out.write(line)
            out.flush()
            if self.first_failure_at is None and TASK_FAILURE_RE.search(line):
                self.first_failure_at = time.monotonic()
                self.failed_line = line.decode(errors="replace").strip()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def finish(self) -> None:
        self._reader.join(timeout=5)


def first_attempt(run_dir: Path, attempt_base: int, restarts: int) -> int:
    """This incarnation's first attempt: the submission's own number; after a Slurm requeue, the
    number after every attempt logged (restarts inside an earlier incarnation used numbers too)."""
    from orchestrator.contract.run_dir import attempt_number, next_attempt

    own = attempt_number(attempt_base, restarts)
    return own if restarts == 0 else max(own, next_attempt(run_dir))


@dataclass
class StepEnd:
    """How one training step ended: srun's status, the hang the watchdog found, the node probes."""

    status: int
    hang: Any = None
    hang_reason: str | None = None
    bad_node: str | None = None
    probes: list[Any] | None = None
    watch: StepWatch | None = None  # srun, still running: every node kept its launcher and waits


#: The step's placement on a job with spare nodes (one element), for the hang investigation.
PLACEMENT: list[Placement] = []


def _placement(run_dir: Path) -> Placement | None:
    """Which nodes train and which wait, for a plan with ``spare_nodes`` (None without)."""
    from orchestrator.schedulers.slurm.auto_resume import current_plan

    try:
        plan = current_plan(run_dir)
        return placement_of(
            allocation_nodes(),
            plan.nodes,
            plan.profile.spare_nodes,
            shrink=plan.profile.on_node_loss == "shrink",
            procs_per_node=plan.procs_per_node,
        )
    except Exception as exc:  # noqa: BLE001 (the plan is read again by the node; train without spares)
        say(f"spare nodes off: the plan could not be read ({exc})")
        return None


#: Stop signals the batch step received (cancel, preemption, the time limit's warning): no restart
#: after one, whatever the step's status.
STOP_SIGNALS_SEEN: list[int] = []


def max_restarts_of(run_dir: Path) -> int:
    """The plan's ``max_restarts`` (restarts inside one allocation); 0 when the plan cannot be read
    (the step then runs as without restarts)."""
    from orchestrator.schedulers.slurm.auto_resume import current_plan

    try:
        return current_plan(run_dir).max_restarts
    except Exception as exc:  # noqa: BLE001 (a plan problem must not stop the training)
        say(f"no restarts inside the allocation: the plan could not be read ({exc})")
        return 0


def supervise(
    argv: list[str],
    auto_resume: bool,
    probe_timeout: float,
    attempt_base: int = 0,
    grace_s: float = GRACE_S,
    hang_timeout: float | None = None,
) -> int:
    from orchestrator.schedulers.slurm import auto_resume as ar
    from orchestrator.schedulers.slurm.step_notify import StepNotifier

    run_dir = Path(os.environ[RUN_DIR_ENV])
    job_id = batch_job_id()
    superseded = ar.superseded_by(run_dir, job_id)
    if superseded:
        # Slurm requeued a job (NODE_FAIL) whose after-step check had already submitted its successor.
        say(f"job {job_id} was already auto-resumed as job {superseded}: not training twice")
        return 1
    restarts = batch_restarts()
    attempt = first_attempt(run_dir, attempt_base, restarts)
    if restarts:
        record_attempt(run_dir, job_id, attempt, "requeued", say)
    started = time.time()
    notifier = StepNotifier(run_dir, job_id, attempt, say)
    notifier.attempt_events()
    placement = _placement(run_dir)
    PLACEMENT[:] = [placement] if placement is not None else []
    if _preflight_failed(run_dir, job_id, attempt, auto_resume, placement):
        notifier.ended(1, started)
        notifier.flush()
        return 1
    budget = max_restarts_of(run_dir)
    restarted = 0
    kept: StepWatch | None = None
    may_keep = budget > 0 and os.environ.get(RESTART_IN_PLACE_ENV) != "0"  # a profile's env may say 0
    while True:
        step_argv = argv
        if placement is not None and kept is None:
            step_argv = placement.step_argv(argv)
            spares = ", ".join(placement.spares()) or "none left"
            say(f"training on {', '.join(placement.training())}; spare: {spares}")
        args = (step_argv, run_dir, job_id, attempt, notifier, grace_s, hang_timeout, probe_timeout)
        end = run_step(*args, kept, may_keep)
        if end.status == 0:
            break
        cause, refusal = restart_decision(run_dir, job_id, end, placement, attempt)
        if cause is not None and restarted >= budget:
            cause, refusal = None, f"{restarted} restart(s) reached max_restarts ({cause})"
        if cause is None:
            say(f"not restarted in the allocation: {refusal}")
            if end.watch is not None:
                tell_nodes(run_dir, attempt, None, refusal)
                # srun's status; a hang's report stays (after_hang below: FAILED with its reason)
                end = replace(end, status=in_place.until_srun_ends(end.watch, notifier), watch=None)
            break
        restarted += 1
        failed = attempt
        attempt = restart_in_allocation(
            run_dir, job_id, attempt, cause, restarted, budget, end.watch is not None
        )
        kept = end.watch
        if kept is not None:
            tell_nodes(run_dir, failed, attempt)
        notifier.attempt = attempt
        notifier.attempt_events()
    if end.hang is not None:
        ar.after_hang(run_dir, job_id, end.hang_reason or "hang", end.bad_node, auto_resume, say)
        status = 1
    else:
        status = end.status
    decision = None
    if status != 0 and end.hang is None:
        decision = ar.after_failed_step(
            run_dir,
            job_id,
            status,
            started,
            end.probes,
            auto_resume,
            probe_timeout,
            left_out=placement.left_out if placement is not None else None,
        )
    notifier.ended(
        status, started, decision.reason if decision is not None and decision.action != "none" else None
    )
    notifier.flush()
    if placement is not None and (status != 0 or placement.left_out):  # after any successor's submission
        lost = {p.node for p in end.probes or [] if not p.alive}
        clear_memory_on(run_dir, job_id, [n for n in placement.usable() if n not in lost], say)
    return status


def restart_decision(
    run_dir: Path, job_id: str, end: StepEnd, placement: Placement | None = None, attempt: int | None = None
) -> tuple[str | None, str]:
    """(the cause a restart inside the allocation cures, or None; why not). A lost node needs a
    spare (``placement``) or another allocation (auto-resume's path); a stop signal or a cancel
    means the job is ending. A node the hang watchdog names is left out when a spare can take its
    place."""
    from orchestrator.contract.budget_records import budget_stop
    from orchestrator.contract.run_dir import read_current_plan_json
    from orchestrator.schedulers.slurm.environment import cancelled_by_user
    from orchestrator.supervise.failure_report import restart_verdict

    if STOP_SIGNALS_SEEN:
        return None, f"the job received {signal.Signals(STOP_SIGNALS_SEEN[0]).name}"
    cancelled = cancelled_by_user(run_dir, job_id)
    if cancelled:
        return None, cancelled
    if attempt is not None and budget_stop(run_dir, attempt) is not None:
        return None, "the budget stopped the run"
    lost = [p.node for p in end.probes or [] if not p.alive]
    if lost:
        taken = placement.replace(lost) if placement is not None else None
        if taken:
            return f"node(s) {', '.join(lost)} lost; spare {', '.join(taken)} took the place", ""
        if placement is not None and placement.may_shrink:
            return _shrink(run_dir, placement, lost)
        why = "no spare node left to take its place" if placement is not None else "no spare_nodes"
        return None, f"node(s) {', '.join(lost)} lost and {why} (another allocation is needed)"
    if end.hang is not None:
        cause = end.hang_reason or "the hang watchdog fired"
        taken = placement.replace([end.bad_node]) if placement is not None and end.bad_node else None
        if taken:
            cause += f"; node {end.bad_node} left out, spare {', '.join(taken)} took its place"
        return cause, ""
    procs = read_current_plan_json(run_dir).get("procs_per_node")
    verdict = restart_verdict(run_dir, job_id, procs_per_node=procs if isinstance(procs, int) else 1)
    return verdict.cause, verdict.refusal or ""


def _shrink(run_dir: Path, placement: Placement, lost: list[str]) -> tuple[str | None, str]:
    """``on_node_loss: shrink`` with no spare left: go on with the nodes left, or say why not."""
    from orchestrator.schedulers.slurm.auto_resume import current_plan
    from orchestrator.schedulers.slurm.spares import shrink_refusal

    left = len(placement.usable(tuple(lost)))
    refusal = shrink_refusal(current_plan(run_dir), min(placement.nodes, left)) if left else "no node left"
    if refusal is not None or placement.shrink(lost) is None:
        return None, f"node(s) {', '.join(lost)} lost; not shrinking: {refusal or 'the batch host is lost'}"
    world = placement.nodes * placement.procs_per_node
    return (
        f"node(s) {', '.join(lost)} lost, no spare left: shrinking to {placement.nodes} node(s) "
        f"(world size {world}, the global batch kept by accumulating gradients)",
        "",
    )


def restart_in_allocation(
    run_dir: Path, job_id: str, failed: int, cause: str, n: int, budget: int, kept: bool = False
) -> int:
    """Record the restart (``restarts.jsonl``, the registry's attempt) and return the new attempt's
    number. ``kept``: in place, by the nodes' kept launchers."""
    attempt, step = record_restart(run_dir, job_id, failed, cause, kept, say)
    how = "in place, by the launchers the nodes kept" if kept else "a new step"
    say(f"restart {n}/{budget} in the allocation (attempt {attempt}, from step {step}; {how}): {cause}")
    return attempt


def run_step(
    argv: list[str],
    run_dir: Path,
    job_id: str,
    attempt: int,
    notifier: Any,
    grace_s: float,
    hang_timeout: float | None,
    probe_timeout: float,
    kept: StepWatch | None = None,
    restarts: bool = False,
) -> StepEnd:
    """One srun of the training step as ``attempt``, watched: it ends by itself, or the watchdog
    finds a hang (stacks collected, the step ended), or a task failed and a probe finds a lost node
    (the step ended at once instead of waiting for Slurm to declare the node down), or every node
    kept its launcher (``StepEnd.watch``; ``kept``: that srun, whose nodes start ``attempt`` in place;
    ``restarts``: a new srun's nodes may keep theirs, :mod:`.in_place`)."""
    from orchestrator.schedulers.slurm import auto_resume as ar
    from orchestrator.supervise.watchdog import Watchdog

    watchdog: Watchdog | None = Watchdog(run_dir, attempt, hang_timeout, say)
    shrunk = PLACEMENT[0].step_env() if PLACEMENT else {}
    mark = {RESTART_IN_PLACE_ENV: "1"} if restarts else {}
    watch = kept or StepWatch(argv, {**os.environ, STEP_ATTEMPT_ENV: str(attempt), **shrunk, **mark})
    nodes = PLACEMENT[0].nodes if PLACEMENT else in_place.planned_nodes(run_dir)
    probes: list[ar.ProbeResult] | None = None
    status: int | None = None
    kept_at: float | None = None
    while status is None:
        status = watch.wait(0.1 if restarts else 0.5)
        if status is None and restarts and watch.first_failure_at is None:
            code, reported = ended_in_place(run_dir, attempt, nodes)
            if code is not None:
                return StepEnd(code, watch=watch)
            if reported and kept_at is None:  # a node that never reports may be lost: probed below
                kept_at, failed_line = time.monotonic(), "a node's ranks failed; it kept its launcher"
        if status is None and watchdog is not None and watch.first_failure_at is None:
            try:
                hang = watchdog.check()
            except Exception as exc:  # noqa: BLE001 (a watchdog bug must never end the training)
                say(f"hang watchdog off after an error: {exc!r}")
                watchdog, hang = None, None
            if hang is not None:
                reason, bad_node = _investigate_hang(run_dir, attempt, hang)
                if restarts and not _swaps(bad_node):  # in place: the launchers stay, no new step
                    say("stopping the ranks; the nodes keep their launchers")
                    code = in_place.stop_in_place(watch, run_dir, attempt, nodes, reason)
                    if code is not None:
                        return StepEnd(code, hang, reason, bad_node, watch=watch)
                say("ending the step")
                watch.proc.kill()
                watch.proc.wait()
                watch.finish()
                return StepEnd(1, hang, reason, bad_node)
        notifier.poll()
        failed_at = watch.first_failure_at or kept_at
        if status is not None or probes is not None or failed_at is None:
            continue
        if time.monotonic() - failed_at < grace_s:
            continue
        line = watch.failed_line if watch.first_failure_at else failed_line
        say(f"a task failed ({line}) and srun is still waiting after {grace_s:.0f} s: probing the nodes")
        probes = ar.probe_nodes(allocation_nodes(), probe_timeout)
        for p in probes:
            say(f"probe {p.node}: {'alive' if p.alive else 'LOST'} ({p.detail})")
        if any(not p.alive for p in probes):
            say("ending the step now instead of waiting for Slurm to declare the node down")
            watch.proc.kill()
            watch.proc.wait()
            status = 1
    watch.finish()
    if status < 0:  # srun killed by a signal
        status = 128 - status
    return StepEnd(status, probes=probes)


def _preflight_failed(
    run_dir: Path, job_id: str, attempt: int, auto_resume: bool, placement: Placement | None = None
) -> bool:
    """The preflight (:mod:`orchestrator.supervise.preflight`) before training; when it names bad nodes the job
    ends FAILED with the reason and, with ``--auto-resume``, comes back without them (the hang
    watchdog's path). A preflight that breaks by itself never stops the training."""
    from orchestrator.config.render import NODE_SETUP_VAR
    from orchestrator.schedulers.slurm.auto_resume import after_hang, current_plan
    from orchestrator.supervise.preflight import run_preflight

    try:
        nodes = allocation_nodes()
        prefix = srun_on_every_node(nodes, overlap=False)  # the only step: nothing to share with
        setup = os.environ.get(NODE_SETUP_VAR)
        if setup:  # the profile's set-up lines, as each node's task runs them (sbatch.sh.j2)
            prefix += ["bash", "-c", setup, "orchestrator-node-setup"]
        verdict = run_preflight(run_dir, attempt, current_plan(run_dir), nodes, prefix, say)
    except Exception as exc:  # noqa: BLE001
        say(f"preflight skipped after an error: {exc!r}")
        return False
    if verdict is None or not verdict.failed:
        return False
    taken = placement.replace(list(verdict.bad_nodes or [])) if placement is not None else None
    if taken:
        say(
            f"preflight: {verdict.reason}; spare {', '.join(taken)} takes the place of {', '.join(verdict.bad_nodes)}"
        )
        return False
    after_hang(run_dir, job_id, verdict.reason, None, auto_resume, say, bad_nodes=verdict.bad_nodes)
    return True


def _swaps(bad_node: str | None) -> bool:
    """Whether a restart after a hang that names ``bad_node`` puts a spare in its place (a new step)."""
    import copy

    return bool(PLACEMENT and bad_node and copy.deepcopy(PLACEMENT[0]).replace([bad_node]))


def _investigate_hang(run_dir: Path, attempt: int, hang: Any) -> tuple[str, str | None]:
    """The watchdog fired: every rank's stacks (the ranks must still be there). Returns the reason
    and the node that differed; the caller ends the ranks (in place) or the step, then restarts, or
    records it and, with ``--auto-resume``, resubmits without that node."""
    from orchestrator.contract.run_dir import read_current_plan_json
    from orchestrator.supervise.watchdog import investigate

    say(f"hang watchdog: {hang.describe()}; collecting every rank's stacks")
    world = read_current_plan_json(run_dir).get("world_size")
    try:
        nodes = PLACEMENT[0].training() if PLACEMENT else allocation_nodes()
        reason, bad_node = investigate(
            run_dir,
            attempt,
            hang,
            nodes,
            srun_on_every_node(nodes),
            world if isinstance(world, int) else None,
        )
    except Exception as exc:  # noqa: BLE001 (the hung step must end whatever the evidence did)
        reason, bad_node = f"hang: {hang.describe()}; stacks not collected: {exc!r}", None
    say(reason)
    return reason, bad_node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.schedulers.slurm.batch_step", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--auto-resume", action="store_true")
    parser.add_argument("--probe-timeout", type=float, default=20.0)
    parser.add_argument("--attempt-base", type=int, default=0, help="the attempt this submission started at")
    parser.add_argument(
        "--hang-timeout", type=float, default=None, help="seconds without progress (default: from step times)"
    )
    parser.add_argument("srun", nargs=argparse.REMAINDER, help="-- srun ARGS...")
    args = parser.parse_args(argv)
    command = args.srun[1:] if args.srun[:1] == ["--"] else args.srun
    if not command:
        parser.error("no step command after --")
    for sig in SURVIVED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: STOP_SIGNALS_SEEN.append(signum))
    return supervise(
        command, args.auto_resume, args.probe_timeout, args.attempt_base, hang_timeout=args.hang_timeout
    )


if __name__ == "__main__":
    sys.exit(main())
