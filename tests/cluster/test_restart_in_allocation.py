"""Recovery inside the allocation on the real Slurm cluster (issue 42): a fault a restart cures costs
seconds in the same job, not a trip through the queue.

- A rank SIGKILLed mid-run (``kill -9``, as the OOM killer does) is back training in the same job id:
  the batch step relaunches the step on the nodes it holds, from the newest complete checkpoint, as
  a new attempt; ``restarts.jsonl``, ``status`` and the registry say so; Slurm never requeued the job;
  the result is bit-equal to an uninterrupted run (local mode at the same world size, run meanwhile).
- ``max_restarts`` is honoured: a rank that aborts (SIGABRT) on every attempt is restarted that many
  times, then the job is FAILED with the rank's death as its reason.
- A Python exception the script raised is not restarted (it would raise again).

The profile here is the test cluster's own with ``max_restarts`` set (``slurm_test`` has 0, so the
other fault tests prove the paths that end a job). Figures (kill to training again) are printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.contract.memory_checkpoints import (
    job_memory_ckpt_prefix,
    memory_ckpt_root,
    node_memory_ckpt_dir,
    user_memory_ckpt_dir,
)
from orchestrator.contract.restarts import read_restarts
from orchestrator.registry.store import Registry
from orchestrator.rundir.summary import iter_metrics
from tests.helpers.cli import REPO, kill_tree, poll, run_cli, sacct_state, user_profile_dir
from tests.helpers.hold import rank_pid
from tests.helpers.run_dirs import launcher_pids, trains
from tests.helpers.slurm_cluster import (
    job_nodes,
    kill_node_processes,
    revive_nodes,
    scancel_quietly,
    slurm,
    wait_for_job_state,
    wait_for_node_state,
)

pytestmark = pytest.mark.slow

TRAIN = str(REPO / "train" / "train.py")
CRASH = str(REPO / "tests" / "scripts" / "crash_rank.py")
STEPS = 40
CKPT_EVERY = 10
RUN_ARGS = [
    *("--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"),
    *("--max-steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY)),
]
TWO_NODES = ["--strategy", "full_shard", "--nodes", "2", "--procs-per-node", "1"]


@pytest.fixture(scope="module")
def env(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("restart_in_allocation")
    out = dict(os.environ)
    out["ORCHESTRATOR_HOME"] = str(base / "home")
    out["ORCHESTRATOR_RUNS"] = str(base / "runs")
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    return out


class Reference:
    """The uninterrupted run this module's tests compare with: ``train/`` at the same world size on
    the local profile, started once, in the background, when the first test asks for it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "submit", "--profile", "local", *TWO_NODES, "--wait",
             "--poll", "1", "--", TRAIN, *RUN_ARGS],
            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self._dir: Path | None = None

    def run_dir(self) -> Path:
        """Its run directory, once it completed (waits for it)."""
        if self._dir is None:
            out, err = self.proc.communicate(timeout=300)
            assert self.proc.returncode == 0, out + err
            self._dir = Path(out.split("run directory ")[-1].split()[0])
        return self._dir


@pytest.fixture(scope="module")
def reference(env: dict[str, str]) -> Iterator[Reference]:
    started = Reference(env)
    yield started
    kill_tree(started.proc.pid)


def submitted(env: dict[str, str], args: list[str]) -> tuple[str, Path]:
    res = run_cli(["submit", *args], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split("submitted job ")[1].split()[0], Path(
        res.stdout.split("run directory ")[1].split()[0]
    )


def slurm_requeues(job_id: str) -> int | None:
    out = slurm("scontrol", "show", "job", job_id, check=False).stdout
    return next((int(w.split("=", 1)[1]) for w in out.split() if w.startswith("Restarts=")), None)


def status_of(env: dict[str, str], job_id: str) -> dict[str, Any]:
    res = run_cli(["status", job_id, "--json"], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return dict(json.loads(res.stdout)["jobs"][0])


def _steps(job_id: str) -> list[str]:
    """The job's steps as sacct lists them (``<id>.0``, ``<id>.1``, ...): a restart as a new step adds one."""
    return slurm("sacct", "-j", job_id, "-n", "-P", "-o", "JobID").stdout.split()


def batch_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob("*_log.err")))


def test_a_killed_rank_trains_again_in_the_same_job(
    env: dict[str, str], reference: Reference, tmp_path: Path
) -> None:
    profiles = user_profile_dir(tmp_path, max_restarts=3)
    job_id, run_dir = submitted(
        env, ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--", TRAIN, *RUN_ARGS]
    )
    try:
        victim = rank_pid(run_dir, 1, min_step=CKPT_EVERY + 2)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_for_job_state(job_id, "COMPLETED", timeout=300)
    finally:
        scancel_quietly(job_id)
    ref_dir = reference.run_dir()

    # One restart, in this job, from a complete checkpoint; no requeue, no new job.
    restarts = read_restarts(run_dir)
    assert len(restarts) == 1, (restarts, batch_log(run_dir)[-3000:])
    restart = restarts[0]
    assert (restart["job_id"], restart["failed_attempt"], restart["attempt"]) == (job_id, 0, 1), restart
    assert "rank 1 died of SIGKILL" in restart["cause"], restart
    assert restart["step"] >= CKPT_EVERY and restart["step"] % CKPT_EVERY == 0, restart
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    assert start["step"] == restart["step"], (start, restart)
    # In place: the nodes' launchers (their pids) outlived the failed ranks and forked attempt 1's,
    # all in the job's one training step (a restart as a new step would be step 1).
    assert restart["in_place"] is True, restart
    assert launcher_pids(run_dir, 0) == launcher_pids(run_dir, 1)
    steps = _steps(job_id)
    assert f"{job_id}.0" in steps and f"{job_id}.1" not in steps, steps
    assert sacct_state(job_id) == "COMPLETED"
    assert slurm_requeues(job_id) == 0
    assert [a.attempt for a in Registry.open(Path(env["ORCHESTRATOR_HOME"])).attempts(job_id)] == [0, 1]
    row = status_of(env, job_id)
    assert row["state"] == "COMPLETED" and row["restarts"] == 1 and row["requeues"] == 0, row
    assert "SIGKILL" in row["restart_causes"][0] and row["continued_as"] is None, row
    table = run_cli(["status", job_id], env, timeout=60).stdout
    assert f"{job_id}: restarted 1 time(s) in its allocation" in table, table

    back = min(e["time"] for e in trains(run_dir) if e["time"] > killed_at)
    events = list(iter_metrics(run_dir))
    started = [e for e in events if e.get("event") == "startup" and e["time"] > killed_at]
    resumed = [e for e in events if e.get("event") == "resume" and e["time"] > killed_at]
    phases = {
        "detected and step ended": restart["time"] - killed_at,
        "step relaunched to the ranks' start": started[0]["process"] - restart["time"] if started else None,
        "ranks' start to the model built": started[0]["model"] - started[0]["process"] if started else None,
        "checkpoint restored": resumed[0]["time"] - started[0]["model"] if started and resumed else None,
        "first step": back - resumed[0]["time"] if resumed else None,
    }
    print(
        f"[restart] kill -9 of rank 1 to its next trained step: {back - killed_at:.1f} s; "
        + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items() if v is not None)
    )

    # Bit-equal to the uninterrupted run: the final state and every loss logged.
    final, ref = (json.loads((d / "final.json").read_text()) for d in (run_dir, ref_dir))
    for key in ("step", "loss", "param_checksum", "optim_checksum"):
        assert final[key] == ref[key], (key, final[key], ref[key])
    want = {e["step"]: e["loss"] for e in trains(ref_dir)}
    differ = {
        e["step"]: (e["loss"], want.get(e["step"]))
        for e in trains(run_dir)
        if e["loss"] != want.get(e["step"])
    }
    assert not differ, differ


def memory_folders(run_dir: Path, job_id: str) -> list[Path]:
    """The job's memory checkpoint folders on the nodes (the test cluster's nodes share this machine's
    ``/dev/shm``): one per allocation and host."""
    parent = user_memory_ckpt_dir(memory_ckpt_root())
    return sorted(parent.glob(f"{job_memory_ckpt_prefix(run_dir, job_id)}*"))


def test_a_restart_in_place_resumes_from_the_nodes_memory_checkpoints(
    env: dict[str, str], reference: Reference, tmp_path: Path
) -> None:
    """``--memory-ckpt-every 2``: each rank's state in its node's memory every 2 steps; the restart in
    place after a ``kill -9`` starts from the newest memory checkpoint every rank holds, bit-equal to
    the uninterrupted run; the nodes' folders of them go with the job. A folder an ended job left on
    n1 (its node task killed with SIGKILL) goes when this job's task starts there; one on a host
    this job does not run on stays."""
    profiles = user_profile_dir(tmp_path, max_restarts=3)
    left = [
        node_memory_ckpt_dir(memory_ckpt_root(), tmp_path / "old_run", "999999", key)
        for key in ("a0-n1", "a0-n9")
    ]
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "w2-r0-s00000004.pt").write_bytes(bytes(1 << 20))
    job_id, run_dir = submitted(
        env,
        ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--", TRAIN, *RUN_ARGS,
         "--memory-ckpt-every", "2"],
    )  # fmt: skip
    try:
        os.kill(rank_pid(run_dir, 1, min_step=CKPT_EVERY + 5), signal.SIGKILL)
        wait_for_job_state(job_id, "COMPLETED", timeout=300)
    finally:
        scancel_quietly(job_id)
    [restart] = read_restarts(run_dir)
    assert restart["in_place"] is True and restart["step"] >= CKPT_EVERY, restart
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    # Rank 1 died working on step 15 or later: every rank held the memory checkpoint of step 12 or later.
    assert start["memory"] is True and start["step"] >= CKPT_EVERY + 2, (start, restart)
    assert start["step"] >= restart["step"] and start["step"] % 2 == 0, (start, restart)
    assert launcher_pids(run_dir, 0) == launcher_pids(run_dir, 1)
    final, ref = (json.loads((d / "final.json").read_text()) for d in (run_dir, reference.run_dir()))
    for key in ("step", "loss", "param_checksum", "optim_checksum"):
        assert final[key] == ref[key], (key, final[key], ref[key])
    want = {e["step"]: e["loss"] for e in trains(reference.run_dir())}
    logged = [(e["step"], e["loss"]) for e in trains(run_dir)]
    assert [(step, want.get(step)) for step, _ in logged] == logged  # both attempts' steps, to the bit
    again = sorted({step for step, _ in logged if [s for s, _ in logged].count(step) > 1})
    assert min(again, default=start["step"] + 1) == start["step"] + 1, (start, again)
    assert memory_folders(run_dir, job_id) == []
    assert [folder.exists() for folder in left] == [False, True], left  # n1's went, n9's is not n1's
    shutil.rmtree(left[1])
    print(
        f"[memory checkpoints] restart in place from step {start['step']} "
        f"(shared checkpoint: {restart['step']})"
    )


def test_a_hung_rank_is_restarted_in_place_after_its_stacks_are_saved(
    env: dict[str, str], reference: Reference, tmp_path: Path
) -> None:
    """The watchdog fires (rank 1 stopped for real), every rank's stacks are saved, then the batch step
    tells the nodes to end their ranks and keep their launchers: the restart is in place, in the job's
    one training step, and the run ends bit-equal to the uninterrupted one. Before, a hang always
    ended the step and restarted as a new one (36 s in the chaos run, 6 of them the new step)."""
    profiles = user_profile_dir(tmp_path, max_restarts=3, hang_timeout=8)
    job_id, run_dir = submitted(
        env, ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--", TRAIN, *RUN_ARGS]
    )
    victim = rank_pid(run_dir, 1, min_step=CKPT_EVERY + 2)
    try:
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        wait_for_job_state(job_id, "COMPLETED", timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
        scancel_quietly(job_id)
    restarts = read_restarts(run_dir)
    assert len(restarts) == 1, (restarts, batch_log(run_dir)[-3000:])
    restart = restarts[0]
    assert (restart["failed_attempt"], restart["attempt"], restart["in_place"]) == (0, 1, True), restart
    hang = json.loads((run_dir / "hang" / "attempt_0" / "hang.json").read_text())
    assert restart["cause"] == hang["reason"] and hang["culprit_rank"] == 1, (restart, hang)
    assert "state stopped" in (run_dir / "hang" / "attempt_0" / "rank_1.txt").read_text()
    assert launcher_pids(run_dir, 0) == launcher_pids(run_dir, 1)
    # Step 0 trained throughout; step 1 is the stacks' srun (py-spy on every node); a restart as a new
    # step would have been step 2.
    steps = _steps(job_id)
    assert {f"{job_id}.0", f"{job_id}.1"} <= set(steps) and f"{job_id}.2" not in steps, steps
    # The batch step's stop word; the first node to read it ended its ranks (the other may have seen
    # that node's exit file first, or its ranks' broken collective).
    assert (
        json.loads((run_dir / "logs" / "attempt_0" / "stop_ranks.json").read_text())["why"] == hang["reason"]
    )
    logs = [(run_dir / "logs" / "attempt_0" / f"node_{node}.log").read_text() for node in (0, 1)]
    assert any("ranks stopped for a restart in place: hang: " in log for log in logs), logs[1][-2000:]
    back = min(e["time"] for e in trains(run_dir) if e["time"] > restart["time"])
    print(f"[restart] hang: SIGSTOP to the next trained step {back - stopped_at:.1f} s (hang_timeout 8 s)")
    final, ref = (json.loads((d / "final.json").read_text()) for d in (run_dir, reference.run_dir()))
    for key in ("step", "loss", "param_checksum", "optim_checksum"):
        assert final[key] == ref[key], (key, final[key], ref[key])


def test_a_hang_past_max_restarts_fails_the_job_with_the_hang_s_report(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``max_restarts: 1``, spent by a first hang (in place); rank 1 stopped again: the nodes, whose
    ranks were stopped in place, are told the restart is refused, and the job ends FAILED with the
    second hang's report (its culprit, its decision), not with what srun's end alone would say."""
    profiles = user_profile_dir(tmp_path, max_restarts=1, hang_timeout=8)
    args = [*RUN_ARGS[:-4], "--max-steps", "400", "--ckpt-every", str(CKPT_EVERY)]
    job_id, run_dir = submitted(
        env, ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--", TRAIN, *args]
    )
    victims: list[int] = []
    try:
        victims.append(rank_pid(run_dir, 1, min_step=CKPT_EVERY + 2))
        os.kill(victims[-1], signal.SIGSTOP)
        restart = poll(lambda: read_restarts(run_dir), 120, "the first hang's restart in place")[0]
        victims.append(rank_pid(run_dir, 1, min_step=restart["step"] + 2))
        assert victims[1] != victims[0], victims
        os.kill(victims[-1], signal.SIGSTOP)
        wait_for_job_state(job_id, "FAILED", timeout=300)
    finally:
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        scancel_quietly(job_id)
    restarts = read_restarts(run_dir)
    assert [(r["failed_attempt"], r["attempt"], r["in_place"]) for r in restarts] == [(0, 1, True)], restarts
    hangs = [json.loads((run_dir / "hang" / f"attempt_{a}" / "hang.json").read_text()) for a in (0, 1)]
    assert [h["culprit_rank"] for h in hangs] == [1, 1] and restarts[0]["cause"] == hangs[0]["reason"], hangs
    assert "not restarted in the allocation: 1 restart(s) reached max_restarts (hang" in batch_log(run_dir)
    for node in (0, 1):
        log = (run_dir / "logs" / "attempt_1" / f"node_{node}.log").read_text()
        assert "not restarted in place: 1 restart(s) reached max_restarts" in log, log[-2000:]
    decision = [json.loads(x) for x in (run_dir / "auto_resume.jsonl").read_text().splitlines()][-1]
    assert decision["action"] == "refused" and decision["reason"].startswith(hangs[1]["reason"]), decision
    assert hangs[1]["bad_node"] in decision["lost_nodes"], decision
    row = poll(lambda: (r := status_of(env, job_id))["state"] == "FAILED" and r, 60, "status to say FAILED")
    assert hangs[1]["reason"] in (row["reason"] or ""), row


def test_max_restarts_is_honoured_then_the_death_is_the_reason(env: dict[str, str], tmp_path: Path) -> None:
    profiles = user_profile_dir(tmp_path, max_restarts=1)
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "2", "--wait",
         "--poll", "0.5", "--", CRASH, "--crash-rank", "1", "--abort"],
        env, timeout=300,
    )  # fmt: skip
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    assert res.returncode == 1, res.stdout + res.stderr
    assert sacct_state(job_id) == "FAILED"
    restarts = read_restarts(run_dir)
    assert [(r["failed_attempt"], r["attempt"]) for r in restarts] == [(0, 1)], restarts
    assert "SIGABRT" in restarts[0]["cause"], restarts
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["attempt_0", "attempt_1"]
    assert "1 restart(s) reached max_restarts" in batch_log(run_dir)
    # The restart was in place; then the nodes, waiting with their launchers kept, were told to end.
    assert restarts[0]["in_place"] is True, restarts
    for node in (0, 1):
        log = (run_dir / "logs" / "attempt_1" / f"node_{node}.log").read_text()
        assert "not restarted in place: 1 restart(s) reached max_restarts" in log, log[-2000:]
    row = status_of(env, job_id)
    assert row["restarts"] == 1 and "SIGABRT" in (row["reason"] or ""), row


def test_a_python_exception_is_not_restarted(env: dict[str, str], tmp_path: Path) -> None:
    profiles = user_profile_dir(tmp_path, max_restarts=3)
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "2", "--wait",
         "--poll", "0.5", "--", CRASH, "--crash-rank", "1"],
        env, timeout=300,
    )  # fmt: skip
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    assert res.returncode == 1, res.stdout + res.stderr
    assert read_restarts(run_dir) == []
    assert [p.name for p in (run_dir / "logs").iterdir()] == ["attempt_0"]
    assert "ValueError: boom from the test script (rank 1) (the script's own error: not restarted)" in (
        batch_log(run_dir)
    )
    row = status_of(env, job_id)
    assert row["state"] == "FAILED" and row["restarts"] == 0 and "ValueError" in (row["reason"] or ""), row


def _kill_rank_1_and_finish(env: dict[str, str], run_dir: Path, job_id: str, min_step: int) -> dict[str, Any]:
    """SIGKILL rank 1 once it trained ``min_step``; the job must complete in the same allocation.
    Returns its one restart record."""
    try:
        os.kill(rank_pid(run_dir, 1, min_step=min_step), signal.SIGKILL)
        wait_for_job_state(job_id, "COMPLETED", timeout=420)
    finally:
        scancel_quietly(job_id)
    restarts = read_restarts(run_dir)
    assert len(restarts) == 1, (restarts, batch_log(run_dir)[-3000:])
    assert (restarts[0]["failed_attempt"], restarts[0]["attempt"]) == (0, 1), restarts
    assert "SIGKILL" in restarts[0]["cause"], restarts
    assert slurm_requeues(job_id) == 0 and sacct_state(job_id) == "COMPLETED"
    return restarts[0]


def test_an_unchanged_trainer_script_restarts_from_its_checkpoint(
    env: dict[str, str], tmp_path: Path
) -> None:
    """examples/trainer_cnn.py, an HF Trainer script with no line of ours: its checkpoint-N folders are
    what the restarted attempt resumes from (orchestrator.hf's resume), and it trains to its end.
    The profile turns restarts in place off: the restart is a new step, as before they existed."""
    import yaml

    base_env = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())["env"]
    in_place_off = {**base_env, "ORCHESTRATOR_RESTART_IN_PLACE": "0"}
    profiles = user_profile_dir(tmp_path, max_restarts=3, env=in_place_off)
    out = tmp_path / "out"
    steps = 120
    job_id, run_dir = submitted(
        env,
        ["--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "2", "--procs-per-node", "1",
         "--strategy", "ddp", "--", str(REPO / "examples" / "trainer_cnn.py"), "--max-steps", str(steps),
         "--save-steps", "10", "--logging-steps", "5", "--output-dir", str(out)],
    )  # fmt: skip
    restart = _kill_rank_1_and_finish(env, run_dir, job_id, min_step=12)
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    assert start["hook"] == "trainer" and start["step"] == restart["step"] >= 10, (start, restart)
    assert start["checkpoint"] == str(out / f"checkpoint-{start['step']}"), start
    assert (out / f"checkpoint-{steps}" / "COMPLETE.json").exists()
    assert restart["in_place"] is False, restart
    assert f"{job_id}.1" in _steps(job_id)


def test_a_deepspeed_job_restarts_in_place(env: dict[str, str], tmp_path: Path) -> None:
    """DeepSpeed's ranks are forked from the launcher's imports, as DDP's: a killed rank's restart is in
    place, the same launchers forking the next attempt's ranks (before, DeepSpeed went through
    torchrun, whose agent no node kept: the restart was a new step); every step is trained once
    after the restart's checkpoint. (Through torchrun, ``launcher: torchrun``, the kept launcher
    starts a new agent: tests/schedulers/local/test_restart_in_place.py.)"""
    profiles = user_profile_dir(tmp_path, max_restarts=3)
    job_id, run_dir = submitted(
        env,
        ["--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "2", "--procs-per-node", "1",
         "--strategy", "deepspeed_zero2", "--", TRAIN, *RUN_ARGS],
    )  # fmt: skip
    restart = _kill_rank_1_and_finish(env, run_dir, job_id, min_step=CKPT_EVERY + 2)
    assert restart["step"] >= CKPT_EVERY and restart["step"] % CKPT_EVERY == 0, restart
    logged = {e["step"] for e in trains(run_dir)}
    assert logged == set(range(1, STEPS + 1)), sorted(set(range(1, STEPS + 1)) - logged)
    assert "started 1 rank(s) by fork" in (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    for node in (0, 1):
        again = (run_dir / "logs" / "attempt_1" / f"node_{node}.log").read_text()
        assert "starting the ranks again in place (restart 1, attempt 1)" in again, again[-2000:]
    assert restart["in_place"] is True, restart
    assert launcher_pids(run_dir, 0) == launcher_pids(run_dir, 1)
    steps = _steps(job_id)
    assert f"{job_id}.0" in steps and f"{job_id}.1" not in steps, steps


def test_a_dead_node_is_replaced_by_the_spare_in_the_same_allocation(
    env: dict[str, str], reference: Reference, tmp_path: Path, slurm_cluster: dict[str, str]
) -> None:
    """``spare_nodes: 1``: the job holds 3 nodes and trains on 2. A training node dies (its slurmd and
    every process on it, as at a power loss): the spare takes its place in the same job, and the
    result is bit-equal to an uninterrupted run. With ``--memory-ckpt-every 2`` each rank's state is
    also copied into the other node's memory: the new step resumes from the newest memory checkpoint
    (the spare's rank gets the lost node's copy from the survivor), not from the shared checkpoint,
    and the job's folders are gone from every node at the end."""
    assert slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE", "netns") == "netns", (
        "needs nodes in namespaces"
    )
    profiles = user_profile_dir(tmp_path, max_restarts=3, spare_nodes=1)
    job_id, run_dir = submitted(
        env,
        ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--", TRAIN, *RUN_ARGS,
         "--memory-ckpt-every", "2"],
    )  # fmt: skip
    victim = ""
    try:
        assert "#SBATCH --nodes=3" in (run_dir / "sbatch.sh").read_text()
        rank_pid(run_dir, 1, min_step=CKPT_EVERY + 5)
        header = (run_dir / "logs" / "attempt_0" / "node_1.log").read_text().splitlines()[0]
        victim = header.split("host=")[1].split()[0]
        allocation = job_nodes(job_id)
        assert len(allocation) == 3 and victim in allocation, (allocation, header)
        killed_at = time.time()
        assert kill_node_processes(victim, include_daemons=True)
        wait_for_job_state(job_id, "COMPLETED", timeout=300)
    finally:
        scancel_quietly(job_id)
        if victim:
            revive_nodes()
            wait_for_node_state(victim, ("idle", "mixed"), timeout=90)
    ref_dir = reference.run_dir()

    restarts = read_restarts(run_dir)
    assert len(restarts) == 1, (restarts, batch_log(run_dir)[-3000:])
    restart = restarts[0]
    assert restart["job_id"] == job_id and f"node(s) {victim} lost; spare" in restart["cause"], restart
    spare = restart["cause"].split("spare ")[1].split()[0]
    assert spare in allocation and spare != victim, (spare, allocation)
    hosts = {
        p.read_text().splitlines()[0].split("host=")[1].split()[0]
        for p in (run_dir / "logs" / "attempt_1").glob("node_*.log")
    }
    assert victim not in hosts and spare in hosts and len(hosts) == 2, hosts
    assert sacct_state(job_id) == "COMPLETED" and slurm_requeues(job_id) == 0
    # Rank 0 logs a step or two after the kill, before the collective breaks: count from the restart.
    back = min(e["time"] for e in trains(run_dir) if e["time"] > restart["time"])
    print(
        f"[spare] node {victim} killed to the next trained step on spare {spare}: {back - killed_at:.1f} s "
        f"(detected, probed and the step ended: {restart['time'] - killed_at:.1f} s; "
        f"relaunched on the spare to its first step: {back - restart['time']:.1f} s)"
    )
    final, ref = (json.loads((d / "final.json").read_text()) for d in (run_dir, ref_dir))
    for key in ("step", "loss", "param_checksum", "optim_checksum"):
        assert final[key] == ref[key], (key, final[key], ref[key])
    start = json.loads((run_dir / "logs" / "attempt_1" / "start.json").read_text())
    # The node died after step 15: both ranks' files of step 14 (or 12) were on the survivor.
    assert start["memory"] is True and start["step"] >= CKPT_EVERY + 2, (start, restart)
    assert start["step"] > restart["step"] and start["step"] % 2 == 0, (start, restart)
    want = {e["step"]: e["loss"] for e in trains(ref_dir)}
    logged = [(e["step"], e["loss"]) for e in trains(run_dir)]
    assert [(step, want.get(step)) for step, _ in logged] == logged  # both attempts' steps, to the bit
    assert min(e["step"] for e in trains(run_dir) if e["time"] > restart["time"]) == start["step"] + 1
    assert memory_folders(run_dir, job_id) == []  # the victim's too (the nodes share /dev/shm here)
    print(f"[spare] resumed from the memory checkpoint of step {start['step']} (shared: {restart['step']})")


def test_without_a_spare_the_job_shrinks_and_keeps_its_global_batch(
    env: dict[str, str], reference: Reference, tmp_path: Path, slurm_cluster: dict[str, str]
) -> None:
    """``on_node_loss: shrink``, no spare: a training node dies and the step goes on alone on the node
    left, in the same job, from the newest complete checkpoint resharded to world size 1, with
    gradients accumulated over twice the micro-batches: every step still sees 8 samples, every sample
    once, and the losses continue where the 2-node run's were (equal up to the reduction order)."""
    assert slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE", "netns") == "netns", (
        "needs nodes in namespaces"
    )
    profiles = user_profile_dir(tmp_path, max_restarts=3, on_node_loss="shrink")
    job_id, run_dir = submitted(
        env, ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--", TRAIN, *RUN_ARGS]
    )
    victim = ""
    try:
        rank_pid(run_dir, 1, min_step=CKPT_EVERY + 2)
        header = (run_dir / "logs" / "attempt_0" / "node_1.log").read_text().splitlines()[0]
        victim = header.split("host=")[1].split()[0]
        assert kill_node_processes(victim, include_daemons=True)
        wait_for_job_state(job_id, "COMPLETED", timeout=300)
    finally:
        scancel_quietly(job_id)
        if victim:
            revive_nodes()
            wait_for_node_state(victim, ("idle", "mixed"), timeout=90)
    ref_dir = reference.run_dir()

    restarts = read_restarts(run_dir)
    assert len(restarts) == 1, (restarts, batch_log(run_dir)[-3000:])
    assert "shrinking to 1 node(s)" in restarts[0]["cause"] and victim in restarts[0]["cause"], restarts
    assert sorted(p.name for p in (run_dir / "logs" / "attempt_1").glob("node_*.log")) == ["node_0.log"]
    assert "--grad-accum 1 -> 2" in (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
    assert sacct_state(job_id) == "COMPLETED" and slurm_requeues(job_id) == 0
    final, ref = (json.loads((d / "final.json").read_text()) for d in (run_dir, ref_dir))
    # 4 samples per rank per micro-batch: 2 ranks x 1, then 1 rank x 2: 8 a step throughout.
    assert final["step"] == STEPS and final["world_size"] == 1 and final["samples_seen"] == STEPS * 8, final
    assert final["samples_seen"] == ref["samples_seen"], (final, ref)
    after = {e["step"]: e["loss"] for e in trains(run_dir) if e["world_size"] == 1}
    want = {e["step"]: e["loss"] for e in trains(ref_dir)}
    assert after and max(after) == STEPS, after
    far = {s: (loss, want[s]) for s, loss in after.items() if abs(loss - want[s]) > 1e-3 * abs(want[s])}
    assert not far, far


def _poll(what: str, found: Any, timeout: float) -> Any:
    """``found()`` once it is truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def test_a_node_back_in_service_is_not_excluded_when_the_spare_is_lost_too(
    env: dict[str, str], tmp_path: Path, slurm_cluster: dict[str, str]
) -> None:
    """The chaos benchmark's second node death (bench/results.md): node B dies, the spare C takes its
    place; B comes back (its slurmd restarted, Slurm: idle); then C dies with no spare left. The
    auto-resume's new job excludes C only and runs on the batch host and B. Before, it excluded B too
    (the probe calls it lost: it left the allocation), which left 1 of the partition's 3 nodes: the
    resubmission was refused and the run needed a person."""
    assert slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE", "netns") == "netns", (
        "needs nodes in namespaces"
    )
    profiles = user_profile_dir(tmp_path, max_restarts=3, spare_nodes=1)
    long_run = [*RUN_ARGS[: RUN_ARGS.index("--max-steps")], "--max-steps", "100000", "--ckpt-every", "20"]
    job_id, run_dir = submitted(
        env,
        ["--profile", "slurm_test", "--profiles-dir", str(profiles), *TWO_NODES, "--auto-resume", "--",
         TRAIN, *long_run],
    )  # fmt: skip
    killed: list[str] = []
    new_job = ""
    try:
        rank_pid(run_dir, 1, min_step=22)
        first = (run_dir / "logs" / "attempt_0" / "node_1.log").read_text().splitlines()[0]
        b = first.split("host=")[1].split()[0]
        assert kill_node_processes(b, include_daemons=True)
        killed.append(b)
        restart = _poll("the spare's restart", lambda: read_restarts(run_dir), 120)[0]
        c = restart["cause"].split("spare ")[1].split()[0]
        # As in the benchmark, b leaves the job's allocation before it comes back: Slurm excises a
        # DOWN node from a --no-kill job. There Slurm set it DOWN itself; here it stays "mixed*" (not
        # responding) for minutes while the job holds it, so the test says what Slurm said there.
        slurm("scontrol", "update", f"NodeName={b}", "State=DOWN", "Reason=dead, as in the benchmark")
        _poll(f"{b} out of the job's allocation", lambda: b not in job_nodes(job_id), 60)
        revive_nodes()
        wait_for_node_state(b, ("idle",), timeout=120)
        killed.remove(b)
        rank_pid(
            run_dir, 1, min_step=restart["step"] + 22
        )  # attempt 1 trains on the spare, past a checkpoint
        assert kill_node_processes(c, include_daemons=True)
        killed.append(c)

        def resubmitted() -> dict[str, Any] | None:
            path = run_dir / "auto_resume.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            return next((json.loads(x) for x in lines if json.loads(x)["action"] != "none"), None)

        decision = _poll("the auto-resume's decision", resubmitted, 180)
        assert decision["action"] == "resubmitted", decision
        assert decision["exclude_nodes"] == [c], decision
        assert f"{b} back in service" in decision["reason"], decision
        new_job = decision["new_job_id"]
        wait_for_job_state(new_job, "RUNNING", timeout=120)
        nodes = job_nodes(new_job)
        assert b in nodes and c not in nodes and len(nodes) == 2, nodes
        after = decision["time"]
        _poll("a step of the new job", lambda: [e for e in trains(run_dir) if e["time"] > after], 180)
    finally:
        # `orchestrator cancel`, not scancel: a plain scancel's TERM can reach node 0 before squeue says
        # CANCELLED, and node 0 then requeues the job like a preemption (the suite once had this
        # test's job train 14 more minutes beside the next tests).
        for job in (job_id, new_job):
            if job:
                run_cli(["cancel", job], env, timeout=60)
        for job in (job_id, new_job):
            if job:
                scancel_quietly(job)
                wait_for_job_state(job, ("CANCELLED", "COMPLETED", "FAILED", "NODE_FAIL"), timeout=120)
        if killed:
            revive_nodes()
            for node in killed:
                wait_for_node_state(node, ("idle", "mixed"), timeout=90)
