"""Local: simulated nodes as processes on this machine (submitit's LocalExecutor), no Slurm.

There is no scheduler to remember a local job, so its state lives in the run directory
(:mod:`orchestrator.schedulers.local.state` reads it): node 0 writes the final outcome when every simulated
node has written its exit code, and ``cancel`` signals the recorded process groups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config.profile.records import time_minutes
from orchestrator.config.scheduler_kinds import SCHEDULER_KINDS
from orchestrator.contract.attempt_start import signal_stop_words
from orchestrator.contract.budget_records import budget_stop
from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import (
    EXIT_REQUEUE,
    EXIT_STATUS_FILE,
    HANG_REPORT_FILE,
    JOB_ID_FILE,
    LOCAL_PIDS_FILE,
    LOCAL_STATE_FILE,
    SUBMITIT_DIR,
    attempt_dir,
    cancel_requested,
    hang_dir,
    node_exit_file,
    read_json,
    write_cancel_marker,
    write_json_atomic,
)
from orchestrator.schedulers.base import (
    NodeEnvironment,
    Request,
    Scheduled,
    Scheduler,
    failed_node,
    node_task,
)

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.contract.job_states import JobState
    from orchestrator.notify.owner import RunNotifier
    from orchestrator.registry.store import JobRecord, Registry
    from orchestrator.schedulers.query import Allocation, QueryResult

LOCALHOST = "127.0.0.1"
#: Seconds from a local job's SIGTERM (``cancel``) to the SIGKILL of what still trains (Slurm's
#: KillWait, 30 s by default); the environment of the submitting command may set it.
KILL_WAIT_ENV = "ORCHESTRATOR_LOCAL_KILL_WAIT_S"
KILL_WAIT_S = 30.0
#: How long node 0 of a local job waits for the other simulated nodes' exit codes.
LOCAL_PEER_WAIT_S = 60.0
CONTROLLER_LOG = "controller.log"


class LocalNodeEnvironment(NodeEnvironment):
    def __init__(self, job_key: str) -> None:
        import submitit

        env = submitit.JobEnvironment()
        self.node_rank = env.global_rank
        self.num_nodes = env.num_tasks
        self.hostnames = [LOCALHOST] * env.num_tasks
        self.job_id = job_key
        self.restarts = 0
        self.shares_host = True
        self.watches_hangs = True
        #: Node 0's owner of the run's notifications (:meth:`begin`).
        self.notifier: RunNotifier | None = None
        try:
            self.kill_wait_s = max(0.0, float(os.environ.get(KILL_WAIT_ENV, KILL_WAIT_S)))
        except ValueError:
            self.kill_wait_s = KILL_WAIT_S

    def main_ip(self, plan: LaunchPlan, attempt_path: Path) -> str:
        return LOCALHOST

    def device_environment(self, plan: LaunchPlan) -> dict[str, str]:
        """Simulated nodes share this machine's GPUs: node N gets the N-th ``procs_per_node`` of them
        (``CUDA_VISIBLE_DEVICES``), so every rank's ``cuda:LOCAL_RANK`` is a GPU of its own. One node
        keeps the environment as it is."""
        if plan.uses_cpu or self.num_nodes < 2:
            return {}
        from orchestrator.config.gpus import count_gpus

        found = count_gpus()
        share = found.visible[
            self.node_rank * plan.procs_per_node : (self.node_rank + 1) * plan.procs_per_node
        ]
        if len(share) < plan.procs_per_node:
            raise RunFailure(
                f"node {self.node_rank}: {plan.nodes} simulated node(s) x {plan.procs_per_node} GPU(s) need "
                f"{plan.world_size} GPUs, this machine has {found.count} ({found.source})"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(share)}

    def failed_peer(self, attempt_path: Path) -> tuple[int, int] | None:
        """What the Slurm step's kill-on-bad-exit does: a simulated node whose training exited
        non-zero (not a requeue) ends the others. Without it node 0's torchrun sat in its 300 s exit
        barrier after node 1 had crashed, and the job read RUNNING for five and a half minutes."""
        return failed_node(attempt_path, self.num_nodes, self.node_rank)

    def keeps_launchers(self, plan: LaunchPlan) -> bool:
        """With ``max_restarts``, as on Slurm: a restart in place, decided by node 0
        (:mod:`orchestrator.schedulers.local.in_allocation`); the profile's ``env:
        {ORCHESTRATOR_RESTART_IN_PLACE: "0"}`` turns it off (no restart then: a local job has no new step)."""
        from orchestrator.contract.env import RESTART_IN_PLACE_ENV

        return plan.max_restarts > 0 and plan.profile.env.get(RESTART_IN_PLACE_ENV, "") != "0"

    def decide_in_place(
        self, plan: LaunchPlan, run_dir: Path, attempt: int, stop_signals: Sequence[int]
    ) -> None:
        if not self.is_first_node:
            return
        from orchestrator.contract.run_dir import node_log_file
        from orchestrator.schedulers.local.in_allocation import decide

        log = node_log_file(attempt_dir(run_dir, attempt), self.node_rank)

        def say(line: str) -> None:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(f"[orchestrator node] {line}\n")

        following = decide(plan, run_dir, self.job_id, attempt, stop_signals, say)
        if following is not None and self.notifier is not None:
            self.notifier.attempt = following
            self.notifier.attempt_events()

    def begin(self, run_dir: Path, attempt: int) -> None:
        """Node 0 owns a local run's notifications (no batch step here): its attempt's events now."""
        if self.is_first_node:
            from orchestrator.notify.owner import RunNotifier

            self.notifier = RunNotifier(run_dir, self.job_id, attempt, _say)
            self.notifier.attempt_events()

    def poll_events(self) -> None:
        if self.notifier is not None:
            self.notifier.poll()

    def finish(self, plan: LaunchPlan, run_dir: Path, attempt: int, code: int) -> bool:
        from orchestrator.schedulers.local.held import write_node_held

        # First, before node 0 waits for its peers: what this node held is ``cost``'s allocation.
        write_node_held(plan, run_dir, attempt, self.node_rank, self.job_id)
        if self.is_first_node:
            write_local_final_state(plan, run_dir, attempt, self.job_id)
            if self.keeps_launchers(plan):
                from orchestrator.schedulers.local.in_allocation import end_kept_nodes

                end_kept_nodes(plan, run_dir, attempt)
            if self.notifier is not None:
                from orchestrator.contract import run_alive

                final = read_json(run_dir / LOCAL_STATE_FILE) or {}
                self.notifier.end(str(final.get("state") or "FAILED"), final.get("reason"))
                # The job has ended: what is left is sending (at most notify.timeout_s), which must
                # not keep the run reading RUNNING nor stop `resume`.
                run_alive.release(run_dir)
                self.notifier.close()
        return False


def _say(line: str) -> None:
    print(f"[orchestrator node] {line}", file=sys.stderr, flush=True)


def write_local_final_state(plan: LaunchPlan, run_dir: Path, attempt: int, job_id: str = "") -> None:
    """Node 0 records the outcome (``local_state.json``) once every simulated node has written its
    exit code."""
    path = attempt_dir(run_dir, attempt)
    deadline = time.monotonic() + LOCAL_PEER_WAIT_S
    codes: dict[int, int] = {}
    while time.monotonic() < deadline:
        for rank in range(plan.nodes):
            exit_file = node_exit_file(path, rank)
            if rank not in codes and exit_file.exists():
                codes[rank] = int(exit_file.read_text().strip() or 1)
        if len(codes) == plan.nodes:
            break
        time.sleep(0.2)
    missing = [r for r in range(plan.nodes) if r not in codes]
    reason: str | None
    cancel_words = ""  # PREEMPTED: what a user's cancel says of the stop
    hang = read_json(hang_dir(run_dir, attempt) / HANG_REPORT_FILE)
    if hang is not None and isinstance(hang.get("reason"), str):  # node 0's watchdog ended it
        state, code, reason = "FAILED", next((c for c in codes.values() if c != 0), 1), hang["reason"]
    elif missing:
        state, code, reason = "FAILED", 1, f"node(s) {missing} did not finish"
    elif all(c == 0 for c in codes.values()):
        state, code, reason = "COMPLETED", 0, None
    elif any(c == EXIT_REQUEUE for c in codes.values()):
        state, code = "PREEMPTED", EXIT_REQUEUE
        reason, cancel_words = signal_stop_words(run_dir, attempt)
    else:
        bad = {r: c for r, c in codes.items() if c != 0}
        state, code = "FAILED", next(iter(bad.values()))
        reason = "non-zero exit on " + ", ".join(f"node {r} (exit {c})" for r, c in sorted(bad.items()))
        from orchestrator.supervise.failure_report import explain_failure

        why = explain_failure(
            run_dir,
            job_id or "JOB",
            procs_per_node=plan.procs_per_node,
            scheduler_logs=LocalScheduler().log_files(run_dir, job_id),
        )
        if why is not None:
            reason = why.summary()
            code = why.exit_codes.get(why.node, code) if why.node is not None else code
    stopped = budget_stop(run_dir, attempt)
    if stopped is not None and state == "PREEMPTED":
        # node 0's budget watch sent the stop: the ranks saved and asked for a requeue, which the
        # budget refuses (orchestrator.node.budget_watch)
        step = (read_json(run_dir / EXIT_STATUS_FILE) or {}).get("step")
        at = f" at step {step}" if isinstance(step, int) else ""
        state, code = "BUDGET", 1
        reason = f"{stopped.get('reason', 'budget')}{at}; continue with resume --budget MORE"
    if state != "COMPLETED" and cancel_requested(run_dir):
        # `orchestrator cancel` sends TERM, which training answers like a preemption (checkpoint, exit
        # 75): without this the job would read PREEMPTED, as if it were waiting to come back.
        how = cancel_words if state == "PREEMPTED" else reason
        state, reason = "CANCELLED", f"cancelled by user ({how})"
    write_json_atomic(
        run_dir / LOCAL_STATE_FILE, {"state": state, "exit_code": code, "reason": reason, "nodes": codes}
    )


@contextlib.contextmanager
def standard_streams_to(log: Path) -> Iterator[None]:
    """Point fds 0-2 at /dev/null and ``log`` while the local job's controller is started.

    submitit's LocalExecutor starts a controller that outlives the CLI with ``Popen`` and no
    redirection, so it would inherit the CLI's stdout: ``JOB=$(orchestrator submit --profile local ...)``
    or a pipe into ``tee`` would then block until the whole job ends, and the controller could
    write into the caller's terminal later."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        with open(os.devnull, "rb") as null_in, open(log, "ab") as out:
            os.dup2(null_in.fileno(), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def owns_run_dir(job: JobRecord) -> bool:
    """Whether ``job`` is the newest job of its run directory (whose ``job_id`` file names it)."""
    try:
        return (Path(job.run_dir) / JOB_ID_FILE).read_text().strip() in ("", job.job_id)
    except OSError:
        return True


def signal_local_process(pid: int, sig: signal.Signals) -> int:
    """Deliver ``sig`` to one recorded local process; returns how many processes were signalled.

    A process-group leader (the contract for ``local_pids.json``) gets the signal on its whole
    group. A pid that is not a group leader is treated as a supervisor such as submitit's local
    controller, which forwards only SIGTERM to its tasks and would simply die of SIGUSR1: it gets
    TERM/INT itself, any other signal goes to its direct children (the node entry points, which
    relay it to the training ranks). SIGKILL cannot be relayed by anyone, so it goes to the whole
    process tree: torchrun's workers live in sessions of their own and would otherwise survive.
    """
    import psutil

    try:
        leader = os.getpgid(pid) == pid and pid != os.getpgrp()
        proc = psutil.Process(pid)
        tree = proc.children(recursive=True) if sig == signal.SIGKILL else []
    except (ProcessLookupError, psutil.NoSuchProcess):
        return 0
    targets: list[psutil.Process]
    if leader:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return 0
        targets = tree
        count = 1
    else:
        if sig == signal.SIGKILL:
            targets = [proc, *tree]
        elif sig in (signal.SIGTERM, signal.SIGINT):
            targets = [proc]
        else:
            targets = proc.children(recursive=False) or [proc]
        count = 0
    for target in targets:
        try:
            target.send_signal(sig)
            count += 1
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            raise PermissionError(1, f"not allowed to signal pid {target.pid}") from None
    return count


def gpu_parameters(plan: LaunchPlan) -> dict[str, object]:
    """submitit's ``LocalExecutor`` sets every task's ``CUDA_VISIBLE_DEVICES`` to the GPUs it was asked
    for, none by default: a GPU job's ranks then saw no GPU and trained on CPU (measured on an H200).
    It is given the GPUs this machine lets the job see (``CUDA_VISIBLE_DEVICES`` of the submitting
    shell, else all); the simulated nodes split them (``LocalNodeEnvironment.device_environment``). A CPU
    job keeps none, so a CPU profile never touches a GPU."""
    if plan.uses_cpu:
        return {}
    from orchestrator.config.gpus import count_gpus

    found = count_gpus()
    if not all(entry.isdigit() for entry in found.visible):
        raise UserError(
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}: the local profile passes GPUs "
            "to its simulated nodes by index; give indices (e.g. 0,1), not UUIDs"
        )
    return {"gpus_per_node": len(found.visible), "visible_gpus": tuple(int(e) for e in found.visible)}


class LocalScheduler(Scheduler):
    kind = SCHEDULER_KINDS["local"]
    source_ranks = {"run_dir": 0}  # the run directory is where a local job's state lives

    def dryrun(
        self, plan: LaunchPlan, run_dir: Path, attempt_base: int = 0, python: str | None = None
    ) -> Request:
        folder = Path(run_dir) / SUBMITIT_DIR
        text = (
            f"# local job: {plan.nodes} simulated node(s) x {plan.procs_per_node} process(es) on this machine\n"
            f"# submitit's LocalExecutor starts one process per node (SUBMITIT_LOCAL_GLOBALID=0..{plan.nodes - 1}):\n"
            f"{python or sys.executable} -u -m submitit.core._submit {folder}\n"
            f"# timeout {max(1, time_minutes(plan.time_limit))} min; {plan.profile.signal.name} "
            f"{plan.profile.signal.seconds_before} s before it\n"
        )
        return Request(plan=plan, run_dir=Path(run_dir), text=text, file_name="", attempt_base=attempt_base)

    def check(self, plan: LaunchPlan) -> None:
        """This machine runs whatever the plan allows, but waits for no other job."""
        if plan.after:
            raise UserError(
                f"--after: profile '{plan.profile_name}' runs locally, where a job cannot wait for another; "
                "use a Slurm profile (or wait for the job first: orchestrator wait JOB)"
            )

    def prepare_run_dir(self, registry: Registry | None, run_dir: Path) -> None:
        """Before a resumed local job takes over ``run_dir``, write the previous job's outcome (read
        from the files about to be replaced) into the registry: afterwards only the registry knows it."""
        from orchestrator.schedulers.local.state import local_state

        if registry is None:
            return
        try:
            previous = (run_dir / JOB_ID_FILE).read_text().strip()
        except OSError:
            return
        if previous:
            try:
                registry.record_state(previous, local_state(run_dir).state, source="run_dir")
            except UserError:
                pass  # not in this registry (another ORCHESTRATOR_HOME): nothing to keep
        (run_dir / LOCAL_STATE_FILE).unlink(missing_ok=True)

    def schedule(self, request: Request, registry: Registry | None) -> Scheduled:
        import submitit

        plan, run_dir = request.plan, request.run_dir
        job_key = registry.allocate_local_id() if registry is not None else ""
        folder = run_dir / SUBMITIT_DIR
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(
            tasks_per_node=plan.nodes,
            timeout_min=max(1, time_minutes(plan.time_limit)),
            signal_delay_s=plan.profile.signal.seconds_before,
            **gpu_parameters(plan),
        )
        folder.mkdir(parents=True, exist_ok=True)
        task = node_task(
            run_dir=str(run_dir), scheduler=self.name, attempt_base=request.attempt_base, job_key=job_key
        )
        # The controller (and through it every simulated node and rank) starts with SIGINT ignored,
        # as a shell starts a background job: Ctrl-C on `submit --wait` reaches the terminal's whole
        # process group, which the controller shares, and killed the job the user was only watching.
        # A Slurm job never hears the terminal; now a local one does not either (`cancel` sends TERM).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            with standard_streams_to(folder / CONTROLLER_LOG):
                job = executor.submit(task)
        finally:
            signal.signal(signal.SIGINT, previous)
        write_json_atomic(run_dir / LOCAL_PIDS_FILE, {"controller": int(job.job_id)})
        return Scheduled(
            job_id=job_key or f"local-{job.job_id}", scheduler_job_id=str(job.job_id), handle=job
        )

    def query(
        self, jobs: Sequence[JobRecord], timeout_s: float, fallback: Mapping[str, JobState]
    ) -> QueryResult:
        from orchestrator.contract.job_states import JobState
        from orchestrator.schedulers.local.state import local_state
        from orchestrator.schedulers.query import QueryResult, SchedulerState

        states: dict[str, SchedulerState] = {}
        errors: list[str] = []
        for job in jobs:
            if not owns_run_dir(job):
                # A later job (`resume`) runs in this run directory now: its files describe that job.
                # This one's outcome was recorded when it was handed over (prepare_run_dir).
                states[job.job_id] = SchedulerState(
                    job_id=job.job_id, state=job.last_state, raw_state=job.last_state.value, source="registry"
                )
                continue
            if not Path(job.run_dir).is_dir():
                # Everything a local job is lives there: without it, say so and keep what the
                # registry recorded (an ended job stays ended: orchestrator.runner.refresh.settle).
                recorded = job.last_state if job.last_state.is_terminal() else JobState.UNKNOWN
                missing = f"run directory {job.run_dir} is missing"
                errors.append(f"job {job.job_id}: {missing}")
                states[job.job_id] = SchedulerState(
                    job_id=job.job_id,
                    state=recorded,
                    raw_state=recorded.value,
                    source="registry",
                    stale=True,
                    reason=f"{missing}; recorded: {job.reason}" if job.reason else missing,
                    exit_code=job.exit_code,
                )
                continue
            ls = local_state(job.run_dir)
            states[job.job_id] = SchedulerState(
                job_id=job.job_id,
                state=ls.state,
                raw_state=ls.state.value,
                source="run_dir",
                reason=ls.reason,
                exit_code=str(ls.exit_code) if ls.exit_code is not None else None,
                node_list="localhost",
            )
        return QueryResult(
            states=states,
            source="run_dir",
            stale=bool(errors),
            errors=tuple(errors),
            calls={},  # no scheduler command: the run directory answers
        )

    def allocations_of(
        self, jobs: Sequence[JobRecord], timeout_s: float
    ) -> dict[str, list[Allocation]] | None:
        """No accounting on this machine: each job's nodes record when their processes started and
        ended (``node_<N>.held.json``, :mod:`orchestrator.schedulers.local.held`)."""
        from orchestrator.schedulers.local.held import local_allocations

        return local_allocations(jobs)

    def cancel(self, job: JobRecord, sig: signal.Signals | None, user: str) -> str:
        from orchestrator.schedulers.local.state import local_state, read_local_pids

        pids = read_local_pids(job.run_dir)
        state = local_state(job.run_dir)
        if not state.alive_pids:
            if state.state.is_terminal():
                raise RunFailure(f"job {job.job_id} has already ended ({state.state}); nothing to cancel")
            if not pids:
                raise RunFailure(
                    f"job {job.job_id} has no running processes yet ({job.run_dir / LOCAL_PIDS_FILE} missing)"
                )
        send = sig or signal.SIGTERM
        if sig is None:
            # Marker first: if the processes die before we return, status must already say CANCELLED.
            write_cancel_marker(job.run_dir, send.name, user)
        sent = 0
        for pid in state.alive_pids:
            try:
                sent += signal_local_process(pid, send)
            except PermissionError as exc:
                raise RunFailure(f"cannot signal pid {pid} of job {job.job_id}: {exc.strerror}") from None
        if sent == 0:
            raise RunFailure(f"job {job.job_id}: none of its processes {sorted(pids.values())} is alive")
        return f"sent {send.name} to {sent} process(es) of job {job.job_id}"

    def log_files(self, run_dir: Path, job_id: str) -> list[Path]:
        folder = Path(run_dir) / SUBMITIT_DIR
        return sorted([*folder.glob(CONTROLLER_LOG), *folder.glob("*_log.*")])

    def node_environment(self, job_key: str) -> NodeEnvironment:
        return LocalNodeEnvironment(job_key)
