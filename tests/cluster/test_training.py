"""The reference training program on the real Slurm cluster: a preempted and resumed job equal to an
uninterrupted local run to the bit, through both launchers; prompt failure on node loss."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import (
    REPO,
    first_train_event,
    job_and_run_dir,
    kill_tree,
    run_cli,
    sacct_state,
    train_losses,
    user_profile_dir,
)
from tests.helpers.hold import held, rank_pid
from tests.helpers.preconditions import require

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
STEPS = 12
TRAIN_ARGS = [
    "--preset",
    "tiny",
    "--data",
    "synthetic",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--max-steps",
    str(STEPS),
    "--log-every",
    "1",
]
#: What each launcher's node log says it did.
LAUNCH_LINE = {
    "direct": "rank(s) by fork",
    "torchrun": "ranks started by torchrun (profile launcher: torchrun)",
}


class References:
    """The uninterrupted local runs (``--profile local``, same world size), one per strategy, each
    started in the background while the first cluster job of that strategy runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.dirs: dict[str, Path] = {}

    def start(self, strategy: str, options: list[str], env: dict[str, str]) -> None:
        if strategy in self.procs:
            return
        runs = self.root / strategy
        self.procs[strategy] = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "submit", "--profile", "local", *options, "--wait",
             "--poll", "0.5", "--", TRAIN, *TRAIN_ARGS],
            cwd=REPO, env={**env, "ORCHESTRATOR_HOME": str(runs / "home"), "ORCHESTRATOR_RUNS": str(runs)},
            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def run_dir(self, strategy: str) -> Path:
        if strategy not in self.dirs:
            proc = self.procs[strategy]
            try:
                out = proc.communicate(timeout=400)[0]
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                raise AssertionError(f"the local {strategy} reference did not finish in 400 s") from None
            assert proc.returncode == 0, out
            self.dirs[strategy] = job_and_run_dir(out)[1]
        return self.dirs[strategy]

    def stop(self) -> None:
        for proc in self.procs.values():
            kill_tree(proc.pid)
        for pids in self.root.glob("*/*/local_pids.json"):  # the local jobs outlive a killed --wait
            for pid in json.loads(pids.read_text()).values():
                kill_tree(int(pid))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    refs = References(tmp_path_factory.mktemp("references"))
    yield refs
    refs.stop()


# ddp and full_shard through the direct launcher: tests/cluster/test_watchdog.py and tests/cluster/test_fault_tolerance.py
# (full_shard through torchrun there too). Between them, every strategy through both launchers.
@pytest.mark.parametrize(
    "strategy, launcher", [("ddp", "torchrun"), ("hybrid_shard", "direct"), ("hybrid_shard", "torchrun")]
)
def test_preempted_two_node_training_equals_local_mode_exactly(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path, references: References, strategy: str, launcher: str
) -> None:
    """2 nodes x 2 ranks, USR2 at step 3, requeued, resumed: every loss (the first attempt's too), the
    final loss and the checksums equal the uninterrupted local run's with ``==``. At world 4 DDP's
    gradient buckets decide the all-reduce's summation order: train/ fixes them before the first step
    of every attempt, or the resumed DDP run drifts by the last bit."""
    options = ["--strategy", strategy, "--nodes", "2", "--procs-per-node", "2"]
    if strategy != "ddp":
        options += ["--wrap-cls", "TransformerBlock"]
    profiles = ["--profiles-dir", str(user_profile_dir(tmp_path, launcher=launcher))]
    res = run_cli(
        ["submit", "--profile", "slurm_test", *profiles, *options, "--", TRAIN, *TRAIN_ARGS],
        orch_env,
        timeout=90,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    references.start(strategy, options, orch_env)
    try:
        # Rank 0 is held from step 4 until the notice is pending in it: the 12 steps cannot end first.
        with held(rank_pid(run_dir, 0, min_step=4), [signal.SIGUSR2]):
            sent = run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60)
            assert sent.returncode == 0, sent.stdout + sent.stderr
        waited = run_cli(["wait", job_id, "--timeout", "300"], orch_env, timeout=320)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert sacct_state(job_id) == "COMPLETED"
    resumed = [e for e in iter_metrics(run_dir) if e.get("event") == "resume"]
    assert len(resumed) == 1 and 3 <= resumed[0]["step"] < STEPS, resumed
    for attempt in (0, 1):
        log = "".join(p.read_text() for p in (run_dir / "logs" / f"attempt_{attempt}").glob("node_*.log"))
        assert log.count(LAUNCH_LINE[launcher]) == 2, log[-3000:]  # each node, each attempt

    local_dir = references.run_dir(strategy)
    want = train_losses(local_dir)
    assert len(want) == STEPS
    got = [(e["step"], e["loss"]) for e in iter_metrics(run_dir) if e.get("event") == "train"]
    assert sorted({step for step, _ in got}) == list(range(1, STEPS + 1))
    differ = {step: (loss, want[step - 1]) for step, loss in got if loss != want[step - 1]}
    assert not differ, f"{strategy}/{launcher}: losses differ from the local run's at (got, want): {differ}"
    final = json.loads((run_dir / "final.json").read_text())
    ref = json.loads((local_dir / "final.json").read_text())
    for key in ("loss", "param_checksum", "optim_checksum"):
        assert final[key] == ref[key], (key, final[key], ref[key])
    assert first_train_event(run_dir)["world_size"] == 4


def _node_training_pids(node: str) -> list[int]:
    """Training workers running inside one node's network namespace (children of accelerate launch)."""
    out = subprocess.run(
        ["ip", "netns", "pids", f"slurm-{node}"], capture_output=True, text=True, timeout=10
    ).stdout
    pids = []
    for pid in map(int, out.split()):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        if "train.py" in " ".join(cmd):  # a forked rank's title is one string (setproctitle)
            pids.append(pid)
    return pids


def test_killing_one_node_fails_the_job_promptly(slurm_cluster: dict, orch_env: dict) -> None:
    if slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE") != "netns":
        require(False, "needs nodes in network namespaces to find one node's processes")
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--strategy",
            "ddp",
            "--nodes",
            "2",
            "--",
            TRAIN,
            *TRAIN_ARGS[:-4],
            "--max-steps",
            "100000",
            "--log-every",
            "1",
        ],
        orch_env,
    )
    assert res.returncode == 0, res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # training is really running: steps are being logged
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count('"train"') >= 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail("training never started")
        nodes = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True
        ).stdout.strip()
        victim = nodes.replace("n[", "n").split(",")[-1].split("-")[-1].rstrip("]")
        victim = victim if victim.startswith("n") else f"n{victim}"
        pids = _node_training_pids(victim)
        assert pids, f"no training processes found on {victim}"
        killed_at = time.monotonic()
        for pid in pids:
            psutil.Process(pid).kill()
        state = sacct_state(job_id, timeout=180)
        elapsed = time.monotonic() - killed_at
        assert state == "FAILED", state
        assert elapsed < 120, f"job took {elapsed:.0f} s to fail"
        (run_dir / "node_failure_seconds.txt").write_text(f"{elapsed:.1f}\n")
        print(f"node {victim} killed -> FAILED after {elapsed:.1f} s")
        logs = "".join(
            p.read_text(errors="replace") for p in (run_dir / "logs" / "attempt_0").glob("node_*.log")
        )
        assert f"host={victim}" in logs and "exit=" in logs  # the log names the node and its exit
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
