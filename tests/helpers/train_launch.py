"""Test helper: launch N simulated nodes x K processes of train/train.py on this machine.

Each node is one ``accelerate launch --config_file <cfg>`` where cfg is what the
orchestrator renders for that node (``orchestrator.config.render.render_accelerate_config``
on a plan from ``orchestrator.config.plan.build_plan`` with the ``local`` profile), with
the environment the node entry gives it (``orchestrator.node.entry.training_environment``:
``ACCELERATE_USE_CPU=1``, the profile's ``OMP_NUM_THREADS=1``, the node site on ``PYTHONPATH``,
``ORCHESTRATOR_*`` expectations). Every launch is bounded
by a timeout, and teardown kills the whole psutil process tree of every launcher
(torchrun puts workers in their own sessions, so a process group is not enough).

Usable by hand too::

    python -m tests.helpers.train_launch --strategy full_shard --fsdp-version 2 --nodes 1 --procs 2 -- --max-steps 20
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from tests.helpers.cli import REPO
from tests.helpers.net import free_port

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
SCRIPT = "train/train.py"

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan

#: Fast, deterministic defaults for tests: tiny model, synthetic data, small batches.
TINY_ARGS = [
    "--preset", "tiny", "--data", "synthetic", "--seed", "0", "--batch-size", "8", "--seq-len", "32",
    "--lr", "3e-3", "--warmup-steps", "5", "--log-every", "5", "--eval-every", "0",
]  # fmt: skip


def render_configs(
    strategy: str,
    fsdp_version: int,
    nodes: int,
    procs: int,
    port: int,
    folder: Path,
    wrap_cls: str | None = None,
    options: dict | None = None,
) -> list[Path]:
    from orchestrator.config.render import (
        NodeRuntime,
        needs_deepspeed_config_file,
        render_accelerate_config,
        render_deepspeed_config,
    )

    plan = train_plan(strategy, fsdp_version, nodes, procs, wrap_cls, options)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(nodes):
        ds_file = None
        if needs_deepspeed_config_file(plan):
            ds_file = folder / f"deepspeed_config.node{rank}.json"
            ds_file.write_text(render_deepspeed_config(plan))
        text = render_accelerate_config(
            plan,
            NodeRuntime(machine_rank=rank, main_process_ip="127.0.0.1", main_process_port=port),
            str(ds_file) if ds_file else None,
        )
        path = folder / f"accelerate_node{rank}.yaml"
        path.write_text(text)
        paths.append(path)
    return paths


def train_plan(
    strategy: str,
    fsdp_version: int,
    nodes: int,
    procs: int,
    wrap_cls: str | None = None,
    options: dict | None = None,
) -> LaunchPlan:
    """The plan ``submit --profile local`` makes for train/train.py with these options."""
    from orchestrator.config.plan import build_plan, merge_options
    from orchestrator.config.profile.load import load_profile

    name, _, profile = load_profile("local")
    merged = merge_options(
        profile, strategy=strategy, fsdp_version=fsdp_version, wrap_cls=wrap_cls, **(options or {})
    )
    return build_plan(name, profile, merged, script=SCRIPT, nodes=nodes, procs_per_node=procs)


#: What the tests' own environment must not hand to a launch: the variables the product sets
#: (a test process run by orchestrator, or by Accelerate, has its own).
_PRODUCT_PREFIXES = ("ORCHESTRATOR_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def node_environments(
    plan: LaunchPlan, run_dir: Path, attempt: int, extra: dict | None = None
) -> list[dict[str, str]]:
    """Each simulated node's environment for ``accelerate launch``: the product's own
    (orchestrator.node.entry.training_environment, on a local node of the plan) over this process's
    environment without the product's variables, with the repository importable and torch's C++ log
    quiet. ``extra`` then sets (None: removes) what a test changes."""
    from orchestrator.node.entry import training_environment
    from orchestrator.schedulers.local.scheduler import LocalNodeEnvironment

    base = {k: v for k, v in os.environ.items() if not k.startswith(_PRODUCT_PREFIXES)}
    base["PYTHONPATH"] = str(REPO) + os.pathsep + base.get("PYTHONPATH", "")
    base["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    envs = []
    for rank in range(plan.nodes):
        node = object.__new__(LocalNodeEnvironment)  # what submitit's task would be: node `rank` of the job
        node.node_rank, node.num_nodes, node.job_id = rank, plan.nodes, f"tests-{run_dir.name}"
        env: dict[str, str | None] = {
            **training_environment(plan, node, run_dir, attempt, base),
            **(extra or {}),
        }
        envs.append({k: v for k, v in env.items() if v is not None})
    return envs


@dataclass
class Launch:
    """N running ``accelerate launch`` processes (one per simulated node)."""

    run_dir: Path
    procs: list[subprocess.Popen]
    logs: list[Path]
    deadline: float
    returncodes: list[int | None] = field(default_factory=list)

    def tree(self) -> list[psutil.Process]:
        """Every process of every launcher, launchers first."""
        found = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                found.append(root)
                found.extend(root.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return found

    def workers(self) -> list[psutil.Process]:
        """The training processes (python running train/train.py), not the launchers."""
        out = []
        for proc in self.tree():
            try:
                cmd = proc.cmdline()
            except psutil.Error:
                continue
            if any(c.endswith(SCRIPT) for c in cmd) and not any("accelerate" in c for c in cmd[:3]):
                out.append(proc)
        return out

    def wait(self, timeout: float | None = None) -> list[int]:
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        codes = []
        for p in self.procs:
            remaining = max(0.1, end - time.monotonic())
            try:
                codes.append(p.wait(timeout=remaining))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(f"training did not finish in time; output:\n{self.output()}") from None
        self.returncodes = codes
        return codes

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process tree (workers live in their own sessions)."""
        procs = self.tree()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
        if sig == signal.SIGKILL:
            psutil.wait_procs(procs, timeout=10)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)

    def output(self) -> str:
        return "\n".join(
            f"--- node {i} ---\n{log.read_text(errors='replace')}"
            for i, log in enumerate(self.logs)
            if log.exists()
        )

    def poll_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``condition`` until true; fail if the time runs out or every launcher has exited."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition():
                return
            if all(p.poll() is not None for p in self.procs):
                if condition():
                    return
                raise AssertionError(f"training exited before {what}; output:\n{self.output()}")
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}; output:\n{self.output()}")


def start(
    run_dir: Path,
    strategy: str,
    fsdp_version: int = 2,
    nodes: int = 1,
    procs: int = 2,
    args: list[str] | None = None,
    timeout: float = 180,
    env: dict | None = None,
    config_paths: list[Path] | None = None,
    wrap_cls: str | None = None,
    options: dict | None = None,
) -> Launch:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_dir = run_dir / "launch"
    launch_dir.mkdir(exist_ok=True)
    if config_paths is None:
        config_paths = render_configs(
            strategy, fsdp_version, nodes, procs, free_port(), launch_dir, wrap_cls, options
        )
    procs_started, logs = [], []
    attempt = len(list(launch_dir.glob("node0-*.log")))
    plan = train_plan(strategy, fsdp_version, nodes, procs, wrap_cls, options)
    envs = node_environments(plan, run_dir, attempt, env)
    for rank, config in enumerate(config_paths):
        log = launch_dir / f"node{rank}-{attempt}.log"
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            SCRIPT,
            *TINY_ARGS,
            *(args or []),
        ]
        with open(log, "wb") as out:
            procs_started.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=envs[rank],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        logs.append(log)
    return Launch(run_dir, procs_started, logs, time.monotonic() + timeout)


def run(
    run_dir: Path,
    strategy: str,
    fsdp_version: int = 2,
    nodes: int = 1,
    procs: int = 2,
    args=None,
    timeout=180,
    env=None,
    wrap_cls: str | None = None,
    options: dict | None = None,
) -> Launch:
    """Start and wait; the Launch has ``returncodes``; the tree is killed on any failure to finish.
    ``options``: more strategy options for the rendered config (``{"state_dict": "full"}``)."""
    launch = start(
        run_dir, strategy, fsdp_version, nodes, procs, args, timeout, env, wrap_cls=wrap_cls, options=options
    )
    try:
        launch.wait()
    finally:
        launch.kill()
    return launch


def assert_ok(launch: Launch) -> None:
    """Every node's launcher exited 0 (the output of all of them otherwise)."""
    assert launch.returncodes and all(code == 0 for code in launch.returncodes), launch.output()


# ---------------------------------------------------------------------------
# Runs shared between test modules (one pytest process): e.g. the 20-step baselines that both the
# equivalence and the resume tests compare against are run once.

_CACHE: dict[tuple, Launch] = {}
_CACHE_DIR: Path | None = None


def cached_runs_dir() -> Path:
    global _CACHE_DIR
    if _CACHE_DIR is None:
        import atexit
        import shutil
        import tempfile

        _CACHE_DIR = Path(tempfile.mkdtemp(prefix="train-runs-"))
        atexit.register(shutil.rmtree, _CACHE_DIR, True)
    return _CACHE_DIR


def cached_run(
    strategy: str,
    fsdp_version: int = 2,
    nodes: int = 1,
    procs: int = 2,
    args: tuple = (),
    timeout: float = 180,
    wrap_cls: str | None = None,
    options: dict | None = None,
) -> Launch:
    """``run`` once per (configuration, args) per pytest process; later calls return the same Launch."""
    key: tuple = (strategy, fsdp_version if strategy != "ddp" else 0, nodes, procs, tuple(args), wrap_cls)
    if options:
        key += (tuple(sorted(options.items())),)
    if key not in _CACHE:
        name = f"{strategy}-v{key[1]}-{nodes}x{procs}-{len(_CACHE)}"
        _CACHE[key] = run(
            cached_runs_dir() / name,
            strategy,
            fsdp_version,
            nodes,
            procs,
            list(args),
            timeout,
            wrap_cls=wrap_cls,
            options=options,
        )
    return _CACHE[key]


# ---------------------------------------------------------------------------
# Reading results


def read_metrics(run_dir: Path, event: str = "train") -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [
        r
        for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
        if r["event"] == event
    ]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a later line for the same step (after a resume) wins."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--fsdp-version", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("train_args", nargs="*")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir or f"/tmp/train-launch-{a.strategy}-{int(time.time())}")
    launch = run(run_dir, a.strategy, a.fsdp_version, a.nodes, a.procs, a.train_args, a.timeout)
    print(launch.output())
    print("returncodes:", launch.returncodes, "run dir:", run_dir)
    return max(launch.returncodes)


if __name__ == "__main__":
    raise SystemExit(main())
