"""The per-node entry point: runs inside the allocation, once per node.

submitit starts one task per node (Slurm) or one per simulated node (local) and
calls ``NodeTask()``. Everything that is known only on the node is decided
here, at run time: this node's rank, the main process IP, the port, and from
those the node's Accelerate config. Then it runs ``accelerate launch`` and
stays in the middle as a signal relay: torchrun forwards only INT/TERM/HUP/QUIT
to its workers, so a pre-timeout USR2 would otherwise never reach training.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from orchestrator.errors import RunFailure

if TYPE_CHECKING:
    from orchestrator.plan import LaunchPlan

# orchestrator.plan/render (pydantic profiles, jinja2: ~0.35 s of imports on 2 busy cores) are imported
# inside the functions that need them: submitit imports this module to unpickle NodeTask, and
# NodeTask starts the launcher's interpreter before paying for them (see PrewarmedLauncher).

#: Exit code of a training run that checkpointed on request and wants to be requeued (EX_TEMPFAIL).
EXIT_REQUEUE = 75
#: Signals relayed to every training process.
FORWARDED_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: How long non-zero nodes wait for node 0 to publish its address.
MAIN_IP_WAIT_S = 120.0
#: After a stop signal, how long a node whose launcher exited non-zero waits for rank 0's
#: ``exit_status.json`` (ranks on other nodes may exit a moment before rank 0 writes it).
REQUEUE_RECORD_WAIT_S = 20.0
#: Signals the launcher itself must survive. Slurm delivers ``scancel --signal`` and the
#: pre-timeout ``--signal`` to every process of the step (proctrack walks the whole tree), and
#: torchrun has no handler for USR1/USR2: their default action would kill it mid-checkpoint.
LAUNCHER_IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: Runs ``accelerate <args>`` with no-op Python handlers for those signals. A caught signal is reset
#: to its default at exec, so the workers torchrun starts keep their ordinary disposition (SIG_IGN
#: would be inherited and silence the workers too).
#:
#: The shim is started before the node knows its command (prewarm): it imports accelerate (and with
#: it torch: ~2 s of CPU, the longest serial step of a local launch) while the node entry imports
#: the plan, renders the node's config and writes it; then it reads one JSON line on stdin
#: ``{"argv", "env", "log"}``, takes that environment, sends its output to the node log and runs
#: ``accelerate <argv>``. An empty line or EOF (the node decided not to launch) exits 0 at once.
_LAUNCHER_SHIM = (
    "import json, os, signal, sys\n"
    "for _s in (signal.SIGUSR1, signal.SIGUSR2):\n"
    "    signal.signal(_s, lambda *_: None)\n"
    "from accelerate.commands.accelerate_cli import main\n"
    "_line = sys.stdin.readline()\n"
    "if not _line.strip():\n"
    "    sys.exit(0)\n"
    "_req = json.loads(_line)\n"
    "_null = os.open(os.devnull, os.O_RDONLY)\n"
    "os.dup2(_null, 0)\n"
    "_log = os.open(_req['log'], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "os.dup2(_log, 1); os.dup2(_log, 2)\n"
    "os.environ.clear(); os.environ.update(_req['env'])\n"
    "sys.argv = ['accelerate', *_req['argv']]\n"
    "sys.exit(main())\n"
)


class PrewarmedLauncher:
    """The launcher's interpreter, started early (see :data:`_LAUNCHER_SHIM`) and handed its
    command later. Measured on 2 busy cores: the node entry spent ~0.5 s importing the plan and
    rendering before it could even start the launcher, whose own imports then took ~2 s more."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            return  # the plain ``accelerate`` command is used then (launcher_argv)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER_SHIM], stdin=subprocess.PIPE, start_new_session=True
        )

    def hand_off(self, argv: list[str], env: dict[str, str], log_path: Path, node_log_bin: IO[bytes]) -> subprocess.Popen[bytes]:
        """Run ``argv`` (``accelerate launch ...``) in the prewarmed interpreter, or start it now."""
        proc, self.proc = self.proc, None
        if proc is None or argv[:1] != ["accelerate"] or proc.poll() is not None:
            if proc is not None:
                _discard(proc)
            return subprocess.Popen(
                launcher_argv(argv), env=env, stdout=node_log_bin, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        assert proc.stdin is not None
        request = json.dumps({"argv": argv[1:], "env": env, "log": str(log_path)})
        try:
            proc.stdin.write(request.encode() + b"\n")
            proc.stdin.close()
        except BrokenPipeError:  # it died while importing: start the command the ordinary way
            _discard(proc)
            return subprocess.Popen(
                launcher_argv(argv), env=env, stdout=node_log_bin, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return proc

    def discard(self) -> None:
        """Not launching after all: stop the prewarmed interpreter."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _discard(proc)


def _discard(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()


@dataclass(frozen=True)
class NodeContext:
    """Where this node stands in the job, read from the scheduler's environment."""

    node_rank: int
    num_nodes: int
    hostnames: list[str]
    job_id: str
    attempt: int
    scheduler: str


def read_node_context(plan: LaunchPlan, job_key: str, attempt_base: int = 0) -> NodeContext:
    """Node rank and host list from submitit's JobEnvironment (Slurm or local alike)."""
    import submitit

    env = submitit.JobEnvironment()
    if plan.profile.scheduler == "slurm":
        hostnames = list(env.hostnames)
        job_id = os.environ.get("SLURM_JOB_ID", str(env.job_id))
        attempt = attempt_base + int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    else:
        hostnames = ["127.0.0.1"] * env.num_tasks
        job_id = job_key
        attempt = attempt_base
    return NodeContext(
        node_rank=env.global_rank,
        num_nodes=env.num_tasks,
        hostnames=hostnames,
        job_id=job_id,
        attempt=attempt,
        scheduler=plan.profile.scheduler,
    )


def interface_address(name: str) -> str:
    """IPv4 address of a network interface on this host (e.g. ib0)."""
    import psutil

    addrs = psutil.net_if_addrs().get(name)
    if not addrs:
        raise RunFailure(f"network_interface '{name}' does not exist on {socket.gethostname()}")
    for addr in addrs:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise RunFailure(f"network_interface '{name}' on {socket.gethostname()} has no IPv4 address")


def resolve_main_ip(plan: LaunchPlan, ctx: NodeContext, attempt_dir: Path) -> str:
    """The address every node uses to reach node 0.

    Without a named interface, every node resolves node 0's hostname itself. With
    one (ib0, eth0 in a namespace), only node 0 can read that interface's address:
    it publishes it in the shared run directory and the others wait for it.
    """
    if ctx.scheduler == "local":
        return "127.0.0.1"
    interface = plan.profile.network_interface
    if not interface:
        return socket.gethostbyname(ctx.hostnames[0])
    published = attempt_dir / "main_ip"
    if ctx.node_rank == 0:
        ip = interface_address(interface)
        tmp = published.with_suffix(".tmp")
        tmp.write_text(ip)
        os.replace(tmp, published)
        return ip
    deadline = time.monotonic() + MAIN_IP_WAIT_S
    while time.monotonic() < deadline:
        if published.exists():
            return published.read_text().strip()
        time.sleep(0.2)
    raise RunFailure(f"node 0 ({ctx.hostnames[0]}) did not publish its {interface} address within {MAIN_IP_WAIT_S:.0f} s")


def training_environment(plan: LaunchPlan, ctx: NodeContext, run_dir: Path) -> dict[str, str]:
    """Environment for ``accelerate launch`` and, through it, every rank."""
    env = dict(os.environ)
    for name, value in plan.profile.env.items():
        env[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    if plan.uses_cpu:
        # Scripts written for GPUs call plain Accelerator(); without this each rank trains alone.
        env["ACCELERATE_USE_CPU"] = "1"
    env.update(
        {
            "ORCHESTRATOR_RUN_DIR": str(run_dir),
            "ORCHESTRATOR_JOB_ID": ctx.job_id,
            "ORCHESTRATOR_ATTEMPT": str(ctx.attempt),
            "ORCHESTRATOR_NODE_RANK": str(ctx.node_rank),
            "ORCHESTRATOR_EXPECTED_WORLD_SIZE": str(plan.world_size),
            "ORCHESTRATOR_EXPECTED_NUM_NODES": str(plan.nodes),
            "ORCHESTRATOR_PROCS_PER_NODE": str(plan.procs_per_node),
            "ORCHESTRATOR_STRATEGY": plan.options.strategy,
            "ORCHESTRATOR_FSDP_VERSION": str(plan.options.fsdp_version),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class SignalRelay:
    """Sends the signals this process receives to every process under the launcher.

    The workers are torchrun's children in sessions of their own; signalling the
    launcher's process group would miss them, so walk the tree each time. Installed
    before the launcher exists: a signal that arrives then is only recorded (the node
    then does not launch at all), never handled by submitit's own handlers (its USR2
    handler would fail or requeue the job behind our back).
    """

    def __init__(self, launcher: subprocess.Popen[bytes] | None, log: Any, stop_signals: tuple[int, ...] = ()) -> None:
        self.launcher = launcher
        self.log = log
        self.stop_signals = stop_signals
        """Signals that end the attempt: one that arrives before any worker exists stops the launcher
        (a worker started later would never hear of it and train on until the hard kill)."""
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in FORWARDED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _say(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 1000) % 1000:03d}"
        print(f"[orchestrator node] {stamp} {line}", file=self.log, flush=True)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        import psutil

        self.received.append(signum)
        name = signal.Signals(signum).name
        if self.launcher is None or self.launcher.returncode is not None:
            self._say(f"received {name} while no training runs")
            return
        try:
            launcher = psutil.Process(self.launcher.pid)
            children = launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        if not children and signum in self.stop_signals:
            # Training has not started: nothing to checkpoint, and a worker spawned after this
            # moment would never get the signal. End the launch; the node reports a requeue.
            with contextlib.suppress(psutil.NoSuchProcess):
                launcher.kill()
            self._say(f"received {name} before training started: launcher stopped")
            return
        # Workers get the signal itself (their handlers checkpoint); the launcher is
        # left alone so it does not SIGKILL them 30 s later (torchrun on TERM).
        targets = children or [launcher]
        for proc in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signum)
        self._say(f"relayed {name} to {len(targets)} process(es)")


def stop_signal(plan: LaunchPlan) -> int:
    """The profile's pre-timeout signal (USR2 by default) as a number."""
    name = plan.profile.signal.name.upper()
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}", signal.SIGUSR2))


def launcher_argv(argv: list[str]) -> list[str]:
    """``accelerate launch ...`` run through :data:`_LAUNCHER_SHIM` with this interpreter, so the
    launcher survives USR1/USR2 (falls back to the plain command where accelerate is not importable)."""
    import importlib.util

    if not argv or argv[0] != "accelerate" or importlib.util.find_spec("accelerate") is None:
        return argv
    return [sys.executable, "-c", _LAUNCHER_SHIM, *argv[1:]]


def requeue_requested(run_dir: Path, launched_at: float) -> bool:
    """Did training checkpoint on request during this launch? (rank 0 writes
    ``exit_status.json`` with code 75 before exiting).

    The exit code itself does not survive torchrun (a failed worker makes it exit 1),
    so training leaves this record in the shared run directory; one older than this
    launch belongs to an earlier attempt.
    """
    try:
        data = json.loads((run_dir / "exit_status.json").read_text())
    except (OSError, ValueError):
        return False
    return data.get("code") == EXIT_REQUEUE and float(data.get("time", 0)) >= launched_at


def wait_for_requeue_record(run_dir: Path, launched_at: float, signalled: bool) -> bool:
    """:func:`requeue_requested`, polled for a while when this node was sent a stop signal: the
    workers of a node without rank 0 can exit before rank 0 has written its record."""
    deadline = time.monotonic() + (REQUEUE_RECORD_WAIT_S if signalled else 0.0)
    while True:
        if requeue_requested(run_dir, launched_at):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def run_node(
    plan: LaunchPlan, run_dir: Path, job_key: str, attempt_base: int = 0, prewarmed: PrewarmedLauncher | None = None
) -> int:
    """Render this node's config, launch training, relay signals; return the exit code.

    ``prewarmed``: a launcher interpreter already importing accelerate (started by ``NodeTask``)."""
    if prewarmed is None:
        prewarmed = PrewarmedLauncher()
    ctx = read_node_context(plan, job_key, attempt_base)
    if ctx.num_nodes != plan.nodes:
        raise RunFailure(f"allocation has {ctx.num_nodes} task(s) but the plan asks for {plan.nodes} node(s)")
    attempt_dir = run_dir / "logs" / f"attempt_{ctx.attempt}"
    attempt_dir.mkdir(parents=True, exist_ok=True)
    node_log_path = attempt_dir / f"node_{ctx.node_rank}.log"
    with open(node_log_path, "ab", buffering=0) as node_log_bin:
        log = open(node_log_bin.fileno(), "w", closefd=False, buffering=1)  # noqa: SIM115 (shares the fd)
        relay = SignalRelay(None, log, stop_signals=(stop_signal(plan), int(signal.SIGTERM)))
        relay.install()
        try:
            code = _launch_and_wait(plan, ctx, run_dir, attempt_dir, log, node_log_bin, relay, prewarmed, node_log_path)
        finally:
            relay.restore()
            prewarmed.discard()  # no-op once handed off
        (attempt_dir / f"node_{ctx.node_rank}.exit").write_text(str(code))
        log.close()
    return code


def _launch_and_wait(
    plan: LaunchPlan,
    ctx: NodeContext,
    run_dir: Path,
    attempt_dir: Path,
    log: Any,
    node_log_bin: Any,
    relay: SignalRelay,
    prewarmed: PrewarmedLauncher,
    node_log_path: Path,
) -> int:
    from orchestrator.render import (
        NodeRuntime,
        accelerate_launch_command,
        port_for_job,
        render_accelerate_config,
    )

    host = socket.gethostname()
    main_ip = resolve_main_ip(plan, ctx, attempt_dir)
    port = port_for_job(ctx.job_id, plan.profile.port_range.start, plan.profile.port_range.end)
    runtime = NodeRuntime(machine_rank=ctx.node_rank, main_process_ip=main_ip, main_process_port=port)
    config_path = attempt_dir / f"accelerate_config.node{ctx.node_rank}.yaml"
    config_path.write_text(render_accelerate_config(plan, runtime))
    argv = accelerate_launch_command(str(config_path), plan.script, plan.script_args)
    # Per-rank logs from torchrun, next to the node log.
    argv[2:2] = ["--log_dir", str(attempt_dir / f"node_{ctx.node_rank}_ranks"), "--tee", "3"]
    print(
        f"[orchestrator node] host={host} node_rank={ctx.node_rank}/{ctx.num_nodes} job={ctx.job_id} "
        f"attempt={ctx.attempt} main={main_ip}:{port} world_size={plan.world_size} "
        f"strategy={plan.options.strategy}",
        file=log,
        flush=True,
    )
    stop = stop_signal(plan)
    if relay.received:
        # Stopped before training started: nothing to checkpoint. The pre-timeout signal asks
        # for a requeue (the next attempt resumes from the last complete checkpoint).
        code = EXIT_REQUEUE if stop in relay.received else 128 + relay.received[0]
        print(f"[orchestrator node] not launched: {signal.Signals(relay.received[0]).name} came first", file=log, flush=True)
        print(f"[orchestrator node] host={host} node_rank={ctx.node_rank} exit={code} after 0.0 s", file=log, flush=True)
        return code
    print(f"[orchestrator node] exec: {' '.join(argv)}", file=log, flush=True)
    env = training_environment(plan, ctx, run_dir)
    started = time.monotonic()
    launched_at = time.time()
    launcher = prewarmed.hand_off(argv, env, node_log_path, node_log_bin)
    (attempt_dir / f"node_{ctx.node_rank}.pid").write_text(str(launcher.pid))
    relay.launcher = launcher
    try:
        code = launcher.wait()
    finally:
        _kill_tree(launcher.pid)
    elapsed = time.monotonic() - started
    pre_timeout = stop in relay.received
    if code != 0 and wait_for_requeue_record(run_dir, launched_at, pre_timeout):
        code = EXIT_REQUEUE
    elif code != 0 and pre_timeout:
        # The pre-timeout/preemption signal reached workers before their handlers were installed
        # (start-up) or training could not checkpoint: still a preemption, not a failure of the
        # run; the next attempt resumes from the last complete checkpoint.
        print(
            f"[orchestrator node] training ended by {signal.Signals(stop).name} without a checkpoint record "
            f"(exit {code}): requeue from the last complete checkpoint",
            file=log,
            flush=True,
        )
        code = EXIT_REQUEUE
    print(
        f"[orchestrator node] host={host} node_rank={ctx.node_rank} exit={code} after {elapsed:.1f} s",
        file=log,
        flush=True,
    )
    return code


def _kill_tree(pid: int) -> None:
    """Leave no worker behind (torchrun's workers live in their own sessions)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


@dataclass
class NodeTask:
    """What submitit pickles and calls on each node (must be importable there)."""

    plan_json: dict[str, Any]
    run_dir: str
    job_key: str = ""
    attempt_base: int = 0
    """Attempts already in the run directory (``resume`` continues the numbering)."""

    def __call__(self) -> int:
        # Outside the launch (run_node relays), a stop signal is noted and otherwise ignored:
        # submitit's own USR2 handler would raise (or requeue) while node 0 decides on the requeue.
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, _note_signal)
        # First of all, so that its imports overlap the plan's and the config rendering.
        prewarmed = PrewarmedLauncher()
        try:
            from orchestrator.plan import LaunchPlan

            plan = LaunchPlan.from_json(self.plan_json)
            run_dir = Path(self.run_dir)
            code = run_node(plan, run_dir, self.job_key, self.attempt_base, prewarmed)
        finally:
            prewarmed.discard()
        if plan.profile.scheduler == "local" and os.environ.get("SUBMITIT_LOCAL_GLOBALID", "0") == "0":
            write_local_final_state(plan, run_dir, self.attempt_base)
        if code == EXIT_REQUEUE:
            if plan.profile.scheduler == "slurm" and os.environ.get("SLURM_NODEID", "0") != "0":
                # Node 0 decides (requeue, or fail once max_requeues is reached). Failing here would
                # make `srun --kill-on-bad-exit` kill node 0 before it could run `scontrol requeue`.
                return code
            maybe_requeue(plan, run_dir)
        if code != 0:
            # A raised error makes the Slurm task exit non-zero, so sacct says FAILED.
            raise RunFailure(f"training exited with code {code} on node {socket.gethostname()}")
        return code


def _note_signal(signum: int, frame: FrameType | None) -> None:
    print(f"[orchestrator node] {signal.Signals(signum).name} ignored: training is not running", file=sys.stderr, flush=True)


#: How long node 0 of a local job waits for the other simulated nodes' exit codes.
LOCAL_PEER_WAIT_S = 60.0


def write_local_final_state(plan: LaunchPlan, run_dir: Path, attempt: int) -> None:
    """Local jobs have no scheduler to remember their outcome: node 0 records it
    (``local_state.json``) once every simulated node has written its exit code."""
    attempt_dir = run_dir / "logs" / f"attempt_{attempt}"
    deadline = time.monotonic() + LOCAL_PEER_WAIT_S
    codes: dict[int, int] = {}
    while time.monotonic() < deadline:
        for rank in range(plan.nodes):
            exit_file = attempt_dir / f"node_{rank}.exit"
            if rank not in codes and exit_file.exists():
                codes[rank] = int(exit_file.read_text().strip() or 1)
        if len(codes) == plan.nodes:
            break
        time.sleep(0.2)
    missing = [r for r in range(plan.nodes) if r not in codes]
    if missing:
        state, code, reason = "FAILED", 1, f"node(s) {missing} did not finish"
    elif all(c == 0 for c in codes.values()):
        state, code, reason = "COMPLETED", 0, None
    elif any(c == EXIT_REQUEUE for c in codes.values()):
        state, code, reason = "PREEMPTED", EXIT_REQUEUE, "checkpointed on a signal and stopped"
    else:
        bad = {r: c for r, c in codes.items() if c != 0}
        state, code, reason = "FAILED", next(iter(bad.values())), f"non-zero exit on node(s) {bad}"
    from orchestrator.run_dir import CANCEL_MARKER

    if state != "COMPLETED" and (run_dir / CANCEL_MARKER).exists():
        # `orchestrator cancel` sends TERM, which training answers like a preemption (checkpoint, exit
        # 75): without this the job would read PREEMPTED, as if it were waiting to come back.
        how = "checkpointed and stopped" if state == "PREEMPTED" else reason
        state, reason = "CANCELLED", f"cancelled by user ({how})"
    tmp = run_dir / "local_state.json.tmp"
    tmp.write_text(json.dumps({"state": state, "exit_code": code, "reason": reason, "nodes": codes}))
    os.replace(tmp, run_dir / "local_state.json")


def cancelled_by_user(run_dir: Path, job_id: str) -> str | None:
    """Why not to requeue: ``orchestrator cancel`` left its marker, or Slurm says CANCELLED
    (a plain ``scancel`` also sends SIGTERM, which training handles like a preemption)."""
    from orchestrator.run_dir import CANCEL_MARKER

    marker = run_dir / CANCEL_MARKER
    if marker.exists():
        return f"cancelled by user ({marker})"
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "Slurm reports the job CANCELLED" if out.startswith("CANCELLED") else None


def maybe_requeue(plan: LaunchPlan, run_dir: Path) -> None:
    """Requeue the Slurm job from node 0 when training asked for it and requeues remain."""
    if plan.profile.scheduler != "slurm" or os.environ.get("SLURM_NODEID", "0") != "0":
        return
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    job_id = os.environ["SLURM_JOB_ID"]
    cancelled = cancelled_by_user(run_dir, job_id)
    if cancelled:
        print(f"[orchestrator node] not requeued: {cancelled}", file=sys.stderr, flush=True)
        return
    if restarts >= plan.max_requeues:
        print(f"[orchestrator node] not requeued: {restarts} requeues reached max_requeues", file=sys.stderr)
        return
    print(f"[orchestrator node] requeueing job {job_id} (requeue {restarts + 1}/{plan.max_requeues})", flush=True)
    subprocess.run(["scontrol", "requeue", job_id], check=False, timeout=60)
