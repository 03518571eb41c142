"""The per-node entry point: runs inside the allocation, once per node.

submitit starts one task per node (Slurm) or one per simulated node (local) and calls
``NodeTask()``. Everything known only on the node is decided here, at run time: this node's rank,
the main process address, the port, and from those the node's Accelerate config. Then it runs
``accelerate launch`` (whose DDP/FSDP ranks :mod:`orchestrator.node.direct_launch` forks) and stays in
the middle as a signal relay (:mod:`orchestrator.node.launcher`).
The plan comes from the run directory (the submission's own ``job.attempt_<A>.json``), the node's
place in the job from the scheduler's :class:`~orchestrator.schedulers.base.NodeEnvironment`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from orchestrator.contract import run_alive
from orchestrator.contract.attempt_start import NO_HOOK, describe_start, read_attempt_start
from orchestrator.contract.env import (
    ATTEMPT_ENV,
    CONTAINER_REPORT_ENV,
    EXPECTED_NUM_NODES_ENV,
    EXPECTED_WORLD_SIZE_ENV,
    FSDP_VERSION_ENV,
    JOB_ID_ENV,
    LAUNCHER_ENV,
    MEMORY_CKPT_DIR_ENV,
    NODE_RANK_ENV,
    PROCS_PER_NODE_ENV,
    RUN_DIR_ENV,
    RUN_NAME_ENV,
    SCRIPT_HOOKS_ENV,
    STRATEGY_ENV,
)
from orchestrator.contract.errors import RunFailure
from orchestrator.contract.in_place import node_kept_file
from orchestrator.contract.run_dir import (
    EXIT_REQUEUE,
    TENSORBOARD_DIR,
    attempt_dir,
    attempt_dirs,
    node_config_file,
    node_deepspeed_config_file,
    node_exit_file,
    node_log_file,
    node_pid_file,
    node_ranks_dir,
    read_plan_json,
)
from orchestrator.contract.run_name import run_name
from orchestrator.node import restart_in_place as in_place
from orchestrator.node.budget_watch import BudgetWatch
from orchestrator.node.hang_watch import NodeHangWatch
from orchestrator.node.launch_store import rendezvous_port
from orchestrator.node.launcher import (
    FORWARDED_SIGNALS,
    Generation,
    PrewarmedLauncher,
    SignalRelay,
    kill_tree,
    stop_signal,
)
from orchestrator.node.site_path import NODE_SITE_DIR

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.schedulers.base import NodeEnvironment


def tracker_run_id(run_dir: Path) -> str:
    """One id for every attempt of a run (requeues, ``resume``): W&B's ``WANDB_RUN_ID`` allows letters,
    digits, ``-`` and ``_``; the digest keeps two runs with the same folder name apart."""
    import hashlib
    import re

    resolved = str(Path(run_dir).resolve())
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(resolved).name).strip("-")[:40] or "run"
    return f"{name}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}"


# orchestrator.config.plan/render (pydantic profiles, jinja2: ~0.35 s of imports on 2 busy cores) are imported
# inside the functions that need them: submitit imports this module to unpickle NodeTask, and
# NodeTask starts the launcher's interpreter before paying for them (see PrewarmedLauncher).


def training_environment(
    plan: LaunchPlan,
    node: NodeEnvironment,
    run_dir: Path,
    attempt: int,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for ``accelerate launch`` and, through it, every rank: ``environ`` (the node task's
    own environment when None) with what the plan, the node and the attempt say. Pure: it reads its
    arguments and changes nothing (the tests launch ``train/`` with it, tests/helpers/train_launch.py)."""
    env = dict(os.environ if environ is None else environ)
    for name, value in plan.profile.env.items():
        env[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    if plan.uses_cpu and plan.strategy.uses_deepspeed:
        # ACCELERATE_USE_CPU=1 would silently make a DeepSpeed config MULTI_CPU DDP. Instead every rank
        # gets the gloo backend (and no JIT-compiled shm op) from node_site/sitecustomize.py, and one
        # thread per rank (measured: 8x slower steps with one process per node otherwise).
        env.pop("ACCELERATE_USE_CPU", None)
        env.setdefault("OMP_NUM_THREADS", "1")
    elif plan.uses_cpu:
        # Scripts written for GPUs call plain Accelerator(); without this each rank trains alone.
        env["ACCELERATE_USE_CPU"] = "1"
    else:
        # A GPU profile: one left over in the submitting shell (local jobs inherit it) would train on CPU.
        env.pop("ACCELERATE_USE_CPU", None)
    env.update(node.device_environment(plan))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (NODE_SITE_DIR, env.get("PYTHONPATH", "")) if p)
    env[SCRIPT_HOOKS_ENV] = "1" if plan.options.script_hooks else "0"
    env[LAUNCHER_ENV] = plan.profile.launcher
    # Trackers keep one run across requeues and resumes (the user's own values win).
    env.setdefault("WANDB_RUN_ID", tracker_run_id(run_dir))
    env.setdefault("WANDB_RESUME", "allow")
    env.setdefault("TENSORBOARD_LOGGING_DIR", str(Path(run_dir) / TENSORBOARD_DIR))
    # A rank killed by SIGSEGV/SIGABRT/SIGBUS (a native crash in torch, gloo or NCCL) prints its Python
    # stack into its log, so the failure report has more to show than an exit code of 139.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if not plan.uses_cpu:
        # Hang evidence on GPUs: NCCL's flight recorder keeps the last collectives of every rank and
        # dumps them into the attempt's log folder when NCCL's own timeout fires (profile env wins).
        env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        env.setdefault(
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(attempt_dir(run_dir, attempt) / "nccl_trace_rank_")
        )
    env.update(
        {
            RUN_DIR_ENV: str(run_dir),
            JOB_ID_ENV: node.job_id,
            RUN_NAME_ENV: run_name(run_dir, node.job_id),
            ATTEMPT_ENV: str(attempt),
            NODE_RANK_ENV: str(node.node_rank),
            EXPECTED_WORLD_SIZE_ENV: str(plan.world_size),
            EXPECTED_NUM_NODES_ENV: str(plan.nodes),
            PROCS_PER_NODE_ENV: str(plan.procs_per_node),
            STRATEGY_ENV: plan.options.strategy,
            FSDP_VERSION_ENV: str(plan.options.fsdp_version),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env[MEMORY_CKPT_DIR_ENV] = str(in_place.memory_ckpt_folder(run_dir, node.job_id, node.memory_key, env))
    return env


def run_node(
    plan: LaunchPlan,
    run_dir: Path,
    node: NodeEnvironment,
    attempt: int,
    prewarmed: PrewarmedLauncher | None = None,
) -> int:
    """Render this node's config, launch training, relay signals; return the exit code.

    ``prewarmed``: a launcher interpreter already importing accelerate (started by ``NodeTask``)."""
    if prewarmed is None:
        prewarmed = PrewarmedLauncher()
    if node.num_nodes != plan.nodes:
        raise RunFailure(
            f"allocation has {node.num_nodes} task(s) but the plan asks for {plan.nodes} node(s)"
        )
    path = attempt_dir(run_dir, attempt)
    path.mkdir(parents=True, exist_ok=True)
    log_path = node_log_file(path, node.node_rank)
    with open(log_path, "ab", buffering=0) as node_log_bin:
        log = open(node_log_bin.fileno(), "w", closefd=False, buffering=1)  # noqa: SIM115 (shares the fd)
        relay = SignalRelay(
            None, log, stop_signals=(stop_signal(plan.profile.signal.name), int(signal.SIGTERM))
        )
        relay.install()
        try:
            code = _launch_and_wait(
                plan, node, run_dir, attempt, path, log, node_log_bin, relay, prewarmed, log_path
            )
        finally:
            relay.restore()
            prewarmed.discard()  # no-op once handed off
        if prewarmed.kept is not None and (code in (0, EXIT_REQUEUE) or relay.received):
            prewarmed.release()  # ended by a stop, or done: nothing to start again in place
        if prewarmed.kept is not None:  # before the exit file: the batch step reads both
            node_kept_file(path, node.node_rank).write_text("")
            print(
                "[orchestrator node] launcher kept: waiting for the word to start the ranks again",
                file=log,
                flush=True,
            )
        # Through a temp file and a rename: node 0 and the peers poll for it, and a file caught
        # between its creation and its write read as empty, which a reader took for exit 1 (a
        # completed local job ended FAILED, "non-zero exit on node 1", under load).
        exit_file = node_exit_file(path, node.node_rank)
        tmp = exit_file.with_name(f".{exit_file.name}.{os.getpid()}.tmp")
        tmp.write_text(str(code))
        os.replace(tmp, exit_file)
        log.close()
    return code


def _launch_and_wait(
    plan: LaunchPlan,
    node: NodeEnvironment,
    run_dir: Path,
    attempt: int,
    path: Path,
    log: Any,
    node_log_bin: Any,
    relay: SignalRelay,
    prewarmed: PrewarmedLauncher,
    log_path: Path,
) -> int:
    from orchestrator.config.render import (
        NodeRuntime,
        accelerate_launch_command,
        needs_deepspeed_config_file,
        render_accelerate_config,
        render_deepspeed_config,
    )
    from orchestrator.contract.requeue import wait_for_requeue_record

    def say(line: str) -> None:
        print(f"[orchestrator node] {line}", file=log, flush=True)

    host = socket.gethostname()
    if prewarmed.kept is not None and prewarmed.rendezvous is not None:
        (main_ip, port), listener = prewarmed.rendezvous, None  # the kept launcher holds its socket
    else:
        main_ip = node.main_ip(plan, path)
        port, listener = rendezvous_port(plan, node, path)
    prewarmed.rendezvous = (main_ip, port)
    runtime = NodeRuntime(machine_rank=node.node_rank, main_process_ip=main_ip, main_process_port=port)
    config_path = node_config_file(path, node.node_rank)
    deepspeed_path = None
    if needs_deepspeed_config_file(plan):
        deepspeed_path = node_deepspeed_config_file(path, node.node_rank)
        deepspeed_path.write_text(render_deepspeed_config(plan))
    config_path.write_text(
        render_accelerate_config(plan, runtime, str(deepspeed_path.resolve()) if deepspeed_path else None)
    )
    argv = accelerate_launch_command(
        str(config_path), plan.script, plan.script_args, log_dir=str(node_ranks_dir(path, node.node_rank))
    )
    print(
        f"[orchestrator node] host={host} node_rank={node.node_rank}/{node.num_nodes} job={node.job_id} "
        f"run={run_name(run_dir, node.job_id)} "
        f"attempt={attempt} main={main_ip}:{port} world_size={plan.world_size} "
        f"strategy={plan.options.strategy} python={sys.executable}",
        file=log,
        flush=True,
    )
    for line in os.environ.pop(CONTAINER_REPORT_ENV, "").splitlines():  # the image's versions
        say(line)
    stop = stop_signal(plan.profile.signal.name)
    if relay.received:
        if listener is not None:
            listener.close()
        # Stopped before training started: nothing to checkpoint. The pre-timeout signal asks
        # for a requeue (the next attempt resumes from the last complete checkpoint).
        code = EXIT_REQUEUE if stop in relay.received else 128 + relay.received[0]
        say(f"not launched: {signal.Signals(relay.received[0]).name} came first")
        say(f"host={host} node_rank={node.node_rank} exit={code} after 0.0 s")
        return code
    say(f"exec: {' '.join(argv)}")
    env = training_environment(plan, node, run_dir, attempt)
    started = time.monotonic()
    launched_at = time.time()
    launcher = prewarmed.hand_off(
        argv, env, log_path, node_log_bin, listener, keep=node.keeps_launchers(plan)
    )
    node_pid_file(path, node.node_rank).write_text(str(launcher.pid))
    relay.launcher = launcher
    budget = BudgetWatch(plan, run_dir, attempt, node, relay, stop, log)
    try:
        hang = NodeHangWatch(plan, run_dir, attempt, node, log)
        code = _wait_or_stop_on_failed_peer(launcher, node, path, log, relay, hang, budget)
    finally:
        kill_tree(launcher.pid)
        budget.meter()
    if code not in (0, EXIT_REQUEUE) and budget.ended_at_once():
        code = EXIT_REQUEUE  # ranks that failed as a peer's were ended at once: the same stop
    if isinstance(launcher, Generation):
        prewarmed.keep(launcher)
    elapsed = time.monotonic() - started
    pre_timeout = stop in relay.received
    if code != 0 and wait_for_requeue_record(run_dir, launched_at, pre_timeout):
        code = EXIT_REQUEUE
    elif code != 0 and pre_timeout:
        # The pre-timeout/preemption signal reached workers before their handlers were installed
        # (start-up) or training could not checkpoint: still a preemption, not a failure of the
        # run. What the next attempt starts from depends on whether the script can restore at all.
        hooked = read_attempt_start(run_dir, attempt) is not None
        then = (
            "requeue: the next attempt resumes from the last complete checkpoint"
            if hooked
            else f"requeue: the next attempt starts again from step 0 ({NO_HOOK.split(': ', 1)[1]})"
        )
        print(
            f"[orchestrator node] training ended by {signal.Signals(stop).name} without a checkpoint record "
            f"(exit {code}): {then}",
            file=log,
            flush=True,
        )
        code = EXIT_REQUEUE
    if node.is_first_node:
        first = min((a for a, _ in attempt_dirs(run_dir)), default=attempt)
        note = describe_start(run_dir, attempt, first)
        if note:
            say(f"attempt {attempt} {note}")
    say(f"host={host} node_rank={node.node_rank} exit={code} after {elapsed:.1f} s")
    return code


#: How often a running node looks for a failed peer or a stop word
#: (NodeEnvironment.failed_peer, told_to_stop).
PEER_CHECK_S = 0.5
#: A node's exit code when a hang ended its training (local: node 0's watchdog, node/hang_watch.py;
#: Slurm: the batch step's stop word after its watchdog fired, a restart in place to follow).
EXIT_HUNG = 1
#: This node's exit code when its training was stopped because another node failed (SIGTERM's).
EXIT_PEER_FAILED = 128 + int(signal.SIGTERM)


def _wait_or_stop_on_failed_peer(
    launcher: Any,
    node: NodeEnvironment,
    path: Path,
    log: Any,
    relay: SignalRelay | None = None,
    hang: NodeHangWatch | None = None,
    budget: BudgetWatch | None = None,
) -> int:
    """Wait for the launcher; if another node of the job fails meanwhile, stop this node's training
    (as the Slurm step's kill-on-bad-exit does) and return :data:`EXIT_PEER_FAILED`. Where the
    scheduler does not kill what outlives a SIGTERM by itself (``node.kill_wait_s``: Slurm's KillWait
    does it there), training still running that long after one is killed (SIGKILL's exit code)."""
    import subprocess

    while True:
        try:
            return int(launcher.wait(timeout=PEER_CHECK_S))
        except subprocess.TimeoutExpired:
            pass
        wait_s = node.kill_wait_s
        if (
            wait_s is not None
            and relay is not None
            and relay.terminated_at is not None
            and time.monotonic() - relay.terminated_at >= wait_s
        ):
            print(
                f"[orchestrator node] training still running {wait_s:.0f} s after SIGTERM: killing it",
                file=log,
                flush=True,
            )
            _end_launch(launcher)
            return 128 + int(signal.SIGKILL)
        # a budget's stop goes to the ranks as a preemption (they save, exit), or ends them during start-up
        if budget is not None and budget.check() and budget.at_once:
            _end_launch(launcher)
            return EXIT_REQUEUE
        node.poll_events()
        if hang is not None and hang.check() is not None:  # hang/attempt_<A>/hang.json says why
            _end_launch(launcher)
            return EXIT_HUNG
        stop = node.told_to_stop(path)
        if stop is not None:
            print(f"[orchestrator node] ranks stopped for a restart in place: {stop}", file=log, flush=True)
            _end_launch(launcher)
            return EXIT_HUNG
        peer = node.failed_peer(path)
        if peer is None:
            continue
        print(
            f"[orchestrator node] stopped because node {peer[0]} failed (exit {peer[1]}): "
            f"one failed node stops every node's ranks",
            file=log,
            flush=True,
        )
        _end_launch(launcher)
        return EXIT_PEER_FAILED


def _end_launch(launcher: Any) -> None:
    """The launcher and every process under it, killed and reaped; a kept launcher's start, by the
    launcher's own kill (:meth:`Generation.kill`: it may not have forked the ranks yet)."""
    if not isinstance(launcher, Generation):
        kill_tree(launcher.pid)
    with contextlib.suppress(OSError):
        launcher.kill()
    launcher.wait()


@dataclass
class NodeTask:
    """What submitit pickles and calls on each node (must be importable there). It carries where
    to look, not what to do: the plan is read from the run directory."""

    run_dir: str
    scheduler: str
    attempt_base: int = 0
    """The attempt this submission started at (``resume`` continues the numbering)."""
    job_key: str = ""
    """The registry's id for a local job (Slurm jobs know their own id)."""

    def __call__(self) -> int:
        # Outside the launch (run_node relays), a stop signal is noted and otherwise ignored:
        # submitit's own USR2 handler would raise (or requeue) while node 0 decides on the requeue.
        for sig in FORWARDED_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on purpose: a local job's SIGINT
                signal.signal(sig, _note_signal)
        run_dir = Path(self.run_dir)
        # Nothing of the run outlives this process's parent (the scheduler's task starter), and the
        # run reads as alive while this process lives (orchestrator.contract.run_alive).
        run_alive.die_with_parent(os.getppid())
        run_alive.hold(run_dir)
        # First of all, so that its imports overlap the plan's and the config rendering.
        prewarmed = PrewarmedLauncher()
        memory_ckpts: Path | None = None
        keep_memory = False  # a later task of this allocation on this node may resume from them
        code = 1
        try:
            from orchestrator.config.plan import LaunchPlan
            from orchestrator.schedulers import get_scheduler

            data = read_plan_json(run_dir, self.attempt_base)
            if data is None:
                raise RunFailure(f"no plan for attempt {self.attempt_base} in {run_dir}")
            plan = LaunchPlan.from_json(data)
            node = get_scheduler(self.scheduler).node_environment(self.job_key)
            attempt = node.attempt(self.attempt_base)
            if node.shrunk_to is not None and node.shrunk_to < plan.nodes:
                # The batch step left a lost node out (on_node_loss: shrink): this step's node count.
                plan = dataclasses.replace(plan, nodes=node.shrunk_to)
            node.begin(run_dir, attempt)
            ranks_env = _profile_env(plan)
            memory_ckpts = in_place.memory_ckpt_folder(run_dir, node.job_id, node.memory_key, ranks_env)
            stale = [
                in_place.memory_ckpt_folder(run_dir, node.job_id, k, ranks_env)
                for k in node.stale_memory_keys()
            ]
            for folder in stale + node.ended_jobs_memory(in_place.memory_ckpt_user_dir(ranks_env)):
                in_place.clear_memory_ckpts(folder)
            if not node.memory_outlives_task(plan):
                in_place.clear_memory_ckpts(memory_ckpts)
            else:
                keep_memory = True
            code = run_node(plan, run_dir, node, attempt, prewarmed)
            while prewarmed.kept is not None:  # a restart in place (orchestrator.node.restart_in_place)
                node.decide_in_place(plan, run_dir, attempt, NOTED_SIGNALS)  # local: node 0 decides
                following = in_place.wait_for_next_attempt(
                    attempt_dir(run_dir, attempt), node.node_rank, NOTED_SIGNALS
                )
                if following is None:
                    break
                attempt = following
                code = run_node(plan, run_dir, node, attempt, prewarmed)
        finally:
            prewarmed.release()
            if memory_ckpts is not None and (not keep_memory or code in (0, EXIT_REQUEUE)):
                in_place.clear_memory_ckpts(memory_ckpts)
        handed_over = node.finish(plan, run_dir, attempt, code)
        if code not in (0, EXIT_REQUEUE) or (code == EXIT_REQUEUE and node.is_first_node and not handed_over):
            # The task exits 1, so the scheduler says FAILED (or, at a requeue, Slurm's requeue and
            # the batch step take over). Nodes other than node 0 return quietly on a requeue: node 0
            # decides it. One line, not a traceback in submitit's log: what happened is in the node's
            # log (the ranks' own tracebacks) and in the failure report.
            ended = "stopped for a requeue" if code == EXIT_REQUEUE else f"exited with code {code}"
            raise SystemExit(f"[orchestrator node] training {ended} on node {socket.gethostname()}")
        return code


def _profile_env(plan: LaunchPlan) -> dict[str, str]:
    """This task's environment with the profile's ``env`` over it, as the ranks get it."""
    return {**os.environ, **{k: str(v) for k, v in plan.profile.env.items()}}


#: Stop signals the node task received outside a launch (a kept launcher's wait ends on one).
NOTED_SIGNALS: list[int] = []


def _note_signal(signum: int, frame: FrameType | None) -> None:
    NOTED_SIGNALS.append(signum)
    print(
        f"[orchestrator node] {signal.Signals(signum).name} ignored: training is not running",
        file=sys.stderr,
        flush=True,
    )
