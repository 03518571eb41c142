"""Fault tolerance on the real Slurm test cluster (tests/cluster): preemption, time limits, node loss,
resharded resume, and a job that fails on its own. No mock anywhere: real sbatch/srun/scontrol, real
signals, real FSDP2 checkpoints.

The reference for "same result as an uninterrupted run" is local mode at the same world size
(``--profile local --nodes 2 --procs-per-node 1``): each batch is a pure function of (step, rank), so a
correct resume gives the same losses and parameter checksum. It runs in the background while the
cluster jobs run, and so does the time-limit job (it mostly waits on Slurm's clock): the file stays
within a few minutes on 2 cores.

Figures measured here (requeue round trip, node-failure detection, steps recomputed) are printed
(``pytest -s``) and written to ``<runs>/fault_tolerance_figures.json``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from orchestrator.contract.jsonfiles import read_json
from orchestrator.contract.run_dir import last_complete_checkpoint
from orchestrator.rundir.summary import iter_metrics
from orchestrator.schedulers.slurm.auto_resume import read_decisions
from tests.helpers.cli import REPO, kill_tree, poll, run_cli, sacct_state, user_profile_dir
from tests.helpers.hold import held, rank_pid
from tests.helpers.preconditions import require
from tests.helpers.run_dirs import trains
from tests.helpers.slurm_cluster import (
    job_nodes,
    kill_node_processes,
    revive_nodes,
    scancel_quietly,
    slurm,
    slurm_node_pids,
    wait_for_job_state,
    wait_for_node_state,
)

pytestmark = pytest.mark.slow

TRAIN = str(REPO / "train" / "train.py")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]
STEPS = 50
CKPT_EVERY = 10
RUN_ARGS = [*TINY, "--max-steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY)]
TWO_NODES_FSDP = [
    "--profile",
    "slurm_test",
    "--strategy",
    "full_shard",
    "--nodes",
    "2",
    "--procs-per-node",
    "1",
]
#: The time-limit job: its first attempt is held at step 3 until Slurm's signal (HeldUntilTimeLimit),
#: so it needs two attempts whatever the machine's speed; the second trains the rest in seconds.
TIME_LIMIT_STEPS = 100
TIME_LIMIT_CKPT_EVERY = 25
TIME_LIMIT_DEADLINE_S = 330.0

FIGURES: dict[str, Any] = {}


# ----------------------------------------------------------------------------------------- helpers


def pick_victim(job_id: str, run_dir: Path, show: Callable[[], str]) -> tuple[str, list[int]]:
    """Once the 2-node job has a complete checkpoint and two more steps: its second node (not the batch
    host, whose batch script runs the after-step check) and that node's training processes."""
    first_ckpt = run_dir / "checkpoints" / f"step_{CKPT_EVERY:08d}" / "COMPLETE.json"
    poll(
        lambda: first_ckpt.exists() and len(trains(run_dir)) >= CKPT_EVERY + 2,
        240,
        "a complete checkpoint and two more steps",
        diagnostics=show,
    )
    nodes = job_nodes(job_id)
    assert len(nodes) == 2, nodes
    victim = nodes[-1]
    return victim, poll(lambda: training_pids(victim, job_id), 30, f"training processes on {victim}")


def resumes(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in iter_metrics(run_dir) if e.get("event") == "resume"]


def segments(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl cut at resume events: per attempt that trained, its resume step (None for the
    first) and its train events."""
    out: list[dict[str, Any]] = [{"resume": None, "train": []}]
    for e in iter_metrics(run_dir):
        if e.get("event") == "resume":
            out.append({"resume": e, "train": []})
        elif e.get("event") == "train":
            out[-1]["train"].append(e)
    return out


def recomputed_steps(run_dir: Path) -> list[int]:
    """For each resume: steps the previous attempt had logged beyond the checkpoint resumed from."""
    last_step = 0
    out = []
    for seg in segments(run_dir):
        if seg["resume"] is not None:
            out.append(max(0, last_step - int(seg["resume"]["step"])))
        if seg["train"]:
            last_step = max(int(e["step"]) for e in seg["train"])
    return out


def last_loss_by_step(run_dir: Path) -> dict[int, float]:
    """The loss each step finally had (a recomputed step overwrites the lost one)."""
    return {int(e["step"]): float(e["loss"]) for e in trains(run_dir)}


def job_and_dir(stdout: str) -> tuple[str, Path]:
    return stdout.split("submitted job ")[1].split()[0], Path(stdout.split("run directory ")[1].split()[0])


def node_logs(run_dir: Path) -> str:
    parts = []
    for path in sorted((run_dir / "logs").glob("attempt_*/node_*.log")):
        text = path.read_text(errors="replace")
        parts.append(f"--- {path.relative_to(run_dir)}\n" + "\n".join(text.splitlines()[-15:]))
    for path in sorted((run_dir / "submitit").glob("*_log.err"))[-4:]:
        parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-12:]))
    return "\n".join(parts)


def submitit_logs(run_dir: Path, job_id: str) -> str:
    """What node 0's submitit process wrote, every attempt of the job (its requeue decision is there)."""
    return "".join(
        p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob(f"{job_id}_0_log.*"))
    )


def diag(job_id: str, run_dir: Path) -> Callable[[], str]:
    def show() -> str:
        state = slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T %M %R", check=False).stdout.strip()
        tail = [json.dumps(e)[:160] for e in list(iter_metrics(run_dir))[-3:]]
        return f"job {job_id}: {state}\nmetrics tail: {tail}\n{node_logs(run_dir)}"

    return show


def submit(
    env: dict[str, str], options: list[str], script_args: list[str], script: str = TRAIN
) -> tuple[str, Path]:
    res = run_cli(["submit", *options, "--", script, *script_args], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_dir(res.stdout)


def training_pids(node: str, job_id: str) -> list[int]:
    """The training workers of one job on one node (torchrun's children running train.py)."""
    pids = []
    for pid in slurm_node_pids(node, job_id=job_id):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        # A forked rank's title is one string (setproctitle): match the joined command line.
        if "train.py" in " ".join(cmd) and "-c" not in cmd:
            pids.append(pid)
    return pids


def slurm_restarts(job_id: str) -> int | None:
    out = slurm("scontrol", "show", "job", job_id, check=False).stdout
    for word in out.split():
        if word.startswith("Restarts="):
            return int(word.split("=", 1)[1])
    return None


def record(name: str, value: Any) -> None:
    FIGURES[name] = value
    print(f"[fault tolerance] {name} = {value}")


class Background:
    """A CLI command running while the tests go on (bounded; killed on teardown)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._result: subprocess.CompletedProcess[str] | None = None

    def result(self, timeout: float) -> subprocess.CompletedProcess[str]:
        if self._result is None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)
                out, err = self.proc.communicate()
                raise AssertionError(
                    f"orchestrator {' '.join(self.args)} did not finish in {timeout:.0f} s\n{out}\n{err}"
                ) from None
            self._result = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        return self._result

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ft_env(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Own registry and runs folder for the module (the background jobs outlive single tests)."""
    base = tmp_path_factory.mktemp("fault_tolerance")
    env = dict(os.environ)
    env["ORCHESTRATOR_HOME"] = str(base / "home")
    env["ORCHESTRATOR_RUNS"] = str(base / "runs")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    yield env
    runs = Path(env["ORCHESTRATOR_RUNS"])
    if FIGURES and runs.is_dir():
        (runs / "fault_tolerance_figures.json").write_text(json.dumps(FIGURES, indent=1))


def selected(request: pytest.FixtureRequest, *names: str) -> bool:
    return any(item.name in names for item in request.session.items)


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, ft_env: dict[str, str]) -> Background | None:
    """The uninterrupted run, in local mode at the same world size, started once in the background."""
    if not selected(
        request,
        "test_preemption_usr2_then_scontrol_requeue_resume_exactly",
        "test_sigkill_on_one_node_fails_then_resume_completes_exactly",
        "test_node_death_with_auto_resume_continues_without_that_node",
        "test_batch_host_death_requeues_the_job_which_resumes",
        "test_real_preemptions_come_back_once_and_a_plain_scancel_stays_cancelled",
    ):
        yield None
        return
    bg = Background(
        [
            "submit",
            "--profile",
            "local",
            "--strategy",
            "full_shard",
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--wait",
            "--poll",
            "1",
            "--",
            TRAIN,
            *RUN_ARGS,
        ],
        ft_env,
    )
    yield bg
    bg.stop()


def reference_dir(bg: Background | None) -> Path:
    assert bg is not None
    res = bg.result(timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = Path(res.stdout.split("run directory ")[-1].split()[0])
    assert (run_dir / "final.json").is_file(), res.stdout
    return run_dir


def assert_same_result(run_dir: Path, ref_dir: Path) -> None:
    """Bit-equal to the uninterrupted run: the final loss and checksums, and every loss the resumed run
    logged (a step recomputed after a resume too, and the lost attempt's steps beyond its checkpoint),
    compared with ``==`` as metrics.jsonl stores them (JSON floats round-trip exactly)."""
    final, ref = read_json(run_dir / "final.json"), read_json(ref_dir / "final.json")
    assert final is not None and ref is not None
    assert final["step"] == ref["step"] == STEPS
    for key in ("loss", "param_checksum", "optim_checksum"):
        assert final[key] == ref[key], (key, final[key], ref[key])
    want = last_loss_by_step(ref_dir)
    assert sorted(last_loss_by_step(run_dir)) == sorted(want) == list(range(1, STEPS + 1))
    differ = {
        e["step"]: (e["loss"], want[e["step"]]) for e in trains(run_dir) if e["loss"] != want[e["step"]]
    }
    assert not differ, f"losses differ from the uninterrupted run's at steps (got, want): {differ}"


class HeldUntilTimeLimit(threading.Thread):
    """Holds the training rank from step 3 until Slurm's time-limit signal is pending in it, so the
    attempt is ended by the time limit however fast it trains (a background job: the other tests run
    meanwhile). Should an attempt end before its step 3, the next one is held instead."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(name="time-limit-hold", daemon=True)
        self.run_dir = run_dir
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            pid = rank_pid(self.run_dir, 0, min_step=3, timeout=TIME_LIMIT_DEADLINE_S / 2)
            with held(pid, [signal.SIGUSR2, signal.SIGTERM], timeout=120):
                pass
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.fixture(scope="module")
def time_limit_job(
    request: pytest.FixtureRequest, ft_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any] | None:
    """Submitted at the start of the module when test_time_limit is selected: it spends most of its
    life waiting on Slurm's clock, so the other tests run meanwhile."""
    if not selected(request, "test_time_limit_reached_over_several_attempts"):
        yield None
        return
    tmp = tmp_path_factory.mktemp("time_limit")
    # With --signal=USR2@10, Slurm (checking every 30 s) signals 10-40 s before the 60 s limit.
    data = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
    data["signal"] = {"name": "USR2", "seconds_before": 10}
    data["max_requeues"] = 8
    profiles = tmp / "profiles"
    profiles.mkdir()
    (profiles / "slurm_test.yaml").write_text(yaml.safe_dump(data))
    job_id, run_dir = submit(
        ft_env,
        ["--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "1", "--time", "1"],
        [*TINY, "--max-steps", str(TIME_LIMIT_STEPS), "--ckpt-every", str(TIME_LIMIT_CKPT_EVERY)],
    )
    hold = HeldUntilTimeLimit(run_dir)
    hold.start()
    info = {"job_id": job_id, "run_dir": run_dir, "hold": hold, "submitted": time.monotonic()}
    yield info
    if sacct_state(job_id, timeout=1) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        scancel_quietly(job_id)
    hold.join(timeout=TIME_LIMIT_DEADLINE_S)


@pytest.fixture(scope="module", autouse=True)
def _start_background(reference: Background | None, time_limit_job: dict[str, Any] | None) -> None:
    """Start the background work before the first test."""


# ----------------------------------------------------------------------------------------- 1. preemption
def test_preemption_usr2_then_scontrol_requeue_resume_exactly(
    ft_env: dict[str, str], reference: Background
) -> None:
    job_id, run_dir = submit(ft_env, TWO_NODES_FSDP, RUN_ARGS)
    show = diag(job_id, run_dir)
    try:
        # Rank 0 is held from step 5 until the notice is pending in it: the run cannot end first.
        rank0 = rank_pid(run_dir, 0, min_step=5)
        # Preemption notice: USR2 to every process of the job's steps.
        t_usr2 = time.time()
        with held(rank0, [signal.SIGUSR2]):
            slurm("scancel", "--signal=USR2", job_id)
        first = poll(lambda: resumes(run_dir), 180, "the resume after USR2", diagnostics=show)[0]
        after = poll(
            lambda: [e for e in segments(run_dir)[1]["train"]],
            120,
            "a step after the resume",
            diagnostics=show,
        )
        round_trip = after[0]["time"] - t_usr2
        record("usr2_round_trip_s", round(round_trip, 1))
        stopped_at = max(e["step"] for e in segments(run_dir)[0]["train"])
        assert first["step"] == stopped_at, "USR2: training must checkpoint the step it stopped at"
        assert after[0]["step"] == first["step"] + 1

        # Requeue by the scheduler (SIGTERM, then requeued): the same, from the last checkpoint. Rank 0
        # is held from the third step after the resume until the TERM is pending in it (or Slurm's
        # SIGCONT of the kill woke it).
        rank0 = rank_pid(run_dir, 0, min_step=first["step"] + 3, timeout=120)
        t_requeue = time.time()
        with held(rank0, [signal.SIGTERM]):
            slurm("scontrol", "requeue", job_id)
        second = poll(
            lambda: resumes(run_dir)[1:], 180, "the resume after scontrol requeue", diagnostics=show
        )[0]
        after2 = poll(
            lambda: segments(run_dir)[2]["train"], 120, "a step after the second resume", diagnostics=show
        )
        record("scontrol_requeue_round_trip_s", round(after2[0]["time"] - t_requeue, 1))
        # Slurm requeued the job itself: node 0 does not requeue it once more
        assert "not requeued again: Slurm requeues the job itself" in submitit_logs(run_dir, job_id)

        poll(lambda: (run_dir / "final.json").exists(), 240, "final.json", diagnostics=show)
        assert sacct_state(job_id, timeout=90) == "COMPLETED"
    finally:
        if not (run_dir / "final.json").exists():
            scancel_quietly(job_id)

    recomputed = recomputed_steps(run_dir)
    record("preemption_steps_recomputed", recomputed)
    assert len(recomputed) >= 2 and all(r <= CKPT_EVERY for r in recomputed), recomputed
    assert second["step"] >= first["step"]
    # Each attempt has its own logs, kept: node logs, rank logs, exit codes. (More than three attempts
    # only if Slurm requeued the job by itself, e.g. NODE_FAIL of a node shared with other tests.)
    attempts = sorted(int(p.name.split("_")[1]) for p in (run_dir / "logs").glob("attempt_*"))
    assert attempts == list(range(len(attempts))) and len(attempts) >= 3, attempts
    for attempt in attempts:
        folder = run_dir / "logs" / f"attempt_{attempt}"
        assert (folder / "node_0.log").is_file() and (folder / "node_1.log").is_file(), attempt
        assert f"attempt={attempt}" in (folder / "node_0.log").read_text()
        if attempt in (0, 1, attempts[-1]):
            assert (folder / "node_0_ranks" / "rank_0.log").is_file(), f"rank logs of attempt {attempt}"
    assert "exit=75" in (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "exit=75" in (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
    assert "exit=0" in (run_dir / "logs" / f"attempt_{attempts[-1]}" / "node_0.log").read_text()
    # the registry knows each requeued attempt and the checkpoint it started from
    from orchestrator.registry.store import Registry

    recorded = Registry.open(Path(ft_env["ORCHESTRATOR_HOME"])).attempts(job_id)
    assert [a.attempt for a in recorded] == attempts, recorded
    started = [Path(a.started_from_checkpoint).name if a.started_from_checkpoint else None for a in recorded]
    assert started[:3] == [None, Path(first["checkpoint"]).name, Path(second["checkpoint"]).name], started
    assert_same_result(run_dir, reference_dir(reference))


# ------------------------------------------------------------------ 2. real preemptions; a plain scancel
#: Partitions of the same nodes as the cluster's own: a job of the second (higher PriorityTier)
#: preempts those of the first. start_cluster.sh configures preemption by partition priority.
SCAVENGER, URGENT = "scavenger", "urgent"


def preempt(job_id: str, run_dir: Path, min_step: int) -> str:
    """An urgent job asks for the first node of ``job_id`` once its rank 0 reached ``min_step``; rank 0
    is held until Slurm's SIGTERM is pending in it (the run cannot end first). The urgent job's id."""
    rank0 = rank_pid(run_dir, 0, min_step=min_step, timeout=120)
    node = job_nodes(job_id)[0]
    with held(rank0, [signal.SIGTERM]):
        return slurm("sbatch", "--parsable", "-p", URGENT, "-w", node, "-N", "1", "--exclusive",
                     "-o", "/dev/null", "--wrap", "true").stdout.strip()  # fmt: skip


def handovers(run_dir: Path) -> list[dict[str, Any]]:
    return [d for d in read_decisions(run_dir) if d.get("action") == "resubmitted"]


def test_real_preemptions_come_back_once_and_a_plain_scancel_stays_cancelled(
    ft_env: dict[str, str], reference: Background, tmp_path: Path
) -> None:
    """Slurm preempts the job for real, twice, under ``requeue_as: new_job`` (what ``auto`` picks with
    Slurm's default cred_expire). First ``PreemptMode=REQUEUE`` without a grace time: Slurm requeues
    the job itself, so node 0 must not hand over to a successor (the run would come back twice). Then
    ``PreemptMode=CANCEL`` with a grace time: nothing but the job brings it back, and node 0 continues
    it as a new job. Each resume starts at the step the job stopped at. Then the user's plain
    ``scancel`` (no ``orchestrator cancel``, so no marker) reaches training as the same SIGTERM, and
    the run stays cancelled. ``orchestrator resume`` then finishes it, equal to the uninterrupted run."""
    partition = os.environ.get("ORCHESTRATOR_TEST_CLUSTER_PARTITION", "debug")
    nodes = slurm("sinfo", "-h", "-p", partition, "-o", "%N").stdout.strip()
    slurm("scontrol", "create", f"PartitionName={SCAVENGER}", f"Nodes={nodes}", "PriorityTier=1",
          "PreemptMode=REQUEUE", "GraceTime=0", "MaxTime=INFINITE", "State=UP")  # fmt: skip
    slurm("scontrol", "create", f"PartitionName={URGENT}", f"Nodes={nodes}", "PriorityTier=10",
          "PreemptMode=OFF", "MaxTime=INFINITE", "State=UP")  # fmt: skip
    profiles = user_profile_dir(tmp_path, partition=SCAVENGER, exclusive=True, requeue_as="new_job")
    job_id, run_dir = submit(ft_env, [*TWO_NODES_FSDP, "--profiles-dir", str(profiles)], RUN_ARGS)
    show = diag(job_id, run_dir)
    urgent: list[str] = []
    successor = ""
    try:
        # 1. PreemptMode=REQUEUE: Slurm requeues the job itself.
        t_preempted = time.time()
        urgent.append(preempt(job_id, run_dir, min_step=5))
        first = poll(lambda: resumes(run_dir), 240, "the resume after Slurm's requeue", diagnostics=show)[0]
        after = poll(lambda: segments(run_dir)[1]["train"], 120, "a step after the resume", diagnostics=show)
        record("preempt_mode_requeue_round_trip_s", round(after[0]["time"] - t_preempted, 1))
        assert first["step"] == max(e["step"] for e in segments(run_dir)[0]["train"]), (
            "preempted: training must checkpoint the step it stopped at"
        )
        assert not handovers(run_dir), "Slurm requeued the job: a successor job would run the run twice"
        assert "not requeued again: Slurm requeues the job itself" in submitit_logs(run_dir, job_id)
        assert slurm_restarts(job_id) == 1

        # 2. PreemptMode=CANCEL with a grace time: the job continues as a new job.
        slurm("scontrol", "update", f"PartitionName={SCAVENGER}", "PreemptMode=CANCEL", "GraceTime=120")
        t_preempted = time.time()
        urgent.append(preempt(job_id, run_dir, min_step=first["step"] + 3))
        second = poll(lambda: resumes(run_dir)[1:], 240, "the resume in the new job", diagnostics=show)[0]
        after = poll(lambda: segments(run_dir)[2]["train"], 120, "a step after it", diagnostics=show)
        record("preempt_mode_cancel_round_trip_s", round(after[0]["time"] - t_preempted, 1))
        assert second["step"] == max(e["step"] for e in segments(run_dir)[1]["train"])
        assert len(handovers(run_dir)) == 1, read_decisions(run_dir)
        successor = str(handovers(run_dir)[0]["new_job_id"])
        for job in urgent:
            assert sacct_state(job, timeout=60) == "COMPLETED", f"the preempting job {job} ran"

        # 3. The user's plain scancel of the job now running, rank 0 held from the third step on.
        rank0 = rank_pid(run_dir, 0, min_step=second["step"] + 3, timeout=120)
        with held(rank0, [signal.SIGTERM]):
            slurm("scancel", successor)
        poll(
            lambda: "not requeued: Slurm's accounting says CANCELLED" in submitit_logs(run_dir, successor),
            120,
            "node 0's word that the cancelled job is not requeued",
            diagnostics=show,
        )
        assert sacct_state(successor, timeout=90).startswith("CANCELLED")
        poll(
            lambda: not slurm("squeue", "-h", "-j", successor, check=False).stdout.strip(), 90, "the job gone"
        )
        assert len(handovers(run_dir)) == 1 and slurm_restarts(successor) == 0, read_decisions(run_dir)
        assert not (run_dir / "logs" / "attempt_3").exists(), node_logs(run_dir)

        res = run_cli(["resume", successor, "--wait", "--poll", "1"], ft_env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr + node_logs(run_dir)
    finally:
        if not (run_dir / "final.json").exists():
            for job in (job_id, successor):
                if job:
                    scancel_quietly(job)
        for job in urgent:
            scancel_quietly(job)
        for name in (SCAVENGER, URGENT):
            slurm("scontrol", "delete", f"PartitionName={name}", check=False)
    assert len(resumes(run_dir)) == 3, resumes(run_dir)
    assert_same_result(run_dir, reference_dir(reference))


# ----------------------------------------------------------------------------------------- 3. hard kill
def test_sigkill_on_one_node_fails_then_resume_completes_exactly(
    ft_env: dict[str, str], reference: Background, tmp_path: Path
) -> None:
    """Through the profile's ``launcher: torchrun`` (the other tests of the file fork their ranks: the
    default direct launcher): both attempts start their ranks by torchrun, and the resumed run equals
    the uninterrupted one to the bit all the same."""
    torchrun = ["--profiles-dir", str(user_profile_dir(tmp_path, launcher="torchrun"))]
    job_id, run_dir = submit(ft_env, [*TWO_NODES_FSDP, *torchrun], RUN_ARGS)
    show = diag(job_id, run_dir)
    try:
        victim, pids = pick_victim(job_id, run_dir, show)
        killed_at = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for_job_state(job_id, "FAILED", timeout=120)
        detection = time.monotonic() - killed_at
        record("node_failure_detection_s", round(detection, 1))
        assert detection < 60, f"FAILED only {detection:.0f} s after the kill"
    finally:
        scancel_quietly(job_id)
    assert sacct_state(job_id) == "FAILED"
    assert slurm_restarts(job_id) in (0, None), "a failed node must not be requeued as a preemption"
    killed_step = max(e["step"] for e in trains(run_dir))
    assert killed_step < STEPS

    res = run_cli(["resume", job_id, "--wait", "--poll", "1"], ft_env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + node_logs(run_dir)
    resumed = resumes(run_dir)
    assert len(resumed) == 1
    recomputed = killed_step - resumed[0]["step"]
    record("hard_kill_steps_recomputed", recomputed)
    assert 0 <= recomputed <= CKPT_EVERY + 1  # the kill may land while a step is being logged
    assert resumed[0]["step"] % CKPT_EVERY == 0
    for attempt in (0, 1):
        log = (run_dir / "logs" / f"attempt_{attempt}" / "node_0.log").read_text()
        assert "ranks started by torchrun (profile launcher: torchrun)" in log, log[-3000:]
    row = json.loads(run_cli(["status", job_id, "--json"], ft_env, timeout=60).stdout)["jobs"][0]
    assert row["state"] == "FAILED" and row["run_state"] == "COMPLETED" and row["continued_as"], row
    assert_same_result(run_dir, reference_dir(reference))


# ----------------------------------------------------------------------------------------- 3b. node death
def test_node_death_with_auto_resume_continues_without_that_node(
    ft_env: dict[str, str], reference: Background, slurm_cluster: dict[str, str]
) -> None:
    """A whole node dies (slurmd and every process on it, as at a power loss): the job fails within
    the measured bound, ``--auto-resume`` submits a new attempt that excludes the dead node, from the
    last complete checkpoint, and it completes with the uninterrupted run's result."""
    if slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE", "netns") != "netns":
        require(False, "needs nodes in network namespaces to kill one node")
    # `submit --wait` must follow the run into the auto-resumed job and answer for it
    runs = Path(ft_env["ORCHESTRATOR_RUNS"])
    before = set(runs.glob("*/job_id"))
    waiter = Background(
        ["submit", *TWO_NODES_FSDP, "--auto-resume", "--wait", "--poll", "1", "--", TRAIN, *RUN_ARGS], ft_env
    )
    id_file = poll(
        lambda: [
            p for p in runs.glob("*/job_id") if p not in before and not p.read_text().startswith("local-")
        ],
        60,
        "the submitted job's id",
    )[0]
    job_id, run_dir = id_file.read_text().strip(), id_file.parent
    show = diag(job_id, run_dir)
    new_job = None
    victim = ""
    try:
        victim, _ = pick_victim(job_id, run_dir, show)
        killed_at = time.monotonic()
        assert kill_node_processes(victim, include_daemons=True)
        decision = poll(
            lambda: read_decisions(run_dir), 120, "the after-step check's decision", diagnostics=show
        )[0]
        record("node_death_to_resubmission_s", round(time.monotonic() - killed_at, 1))
        assert decision["action"] == "resubmitted", decision
        assert decision["lost_nodes"] == [victim] and decision["exclude_nodes"] == [victim], decision
        new_job = decision["new_job_id"]
        assert sacct_state(job_id, timeout=90) in ("FAILED", "NODE_FAIL"), sacct_state(job_id, 1)
        newest = decision["checkpoint"]
        assert newest is not None and int(Path(newest).name.split("_")[1]) % CKPT_EVERY == 0, newest
        poll(lambda: job_nodes(new_job), 120, f"job {new_job} running", diagnostics=diag(new_job, run_dir))
        assert victim not in job_nodes(new_job)
        assert victim in slurm("scontrol", "show", "job", new_job).stdout.split("ExcNodeList=")[1].split()[0]
        poll(lambda: (run_dir / "final.json").exists(), 300, "final.json", diagnostics=diag(new_job, run_dir))
        assert sacct_state(new_job, timeout=90) == "COMPLETED"
        waited = waiter.result(timeout=120)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert f"the run continues as job {new_job}" in waited.stdout, waited.stdout
        assert f"job {new_job} ended COMPLETED" in waited.stdout, waited.stdout
    finally:
        waiter.stop()
        for job in (job_id, new_job):
            if job:
                scancel_quietly(job)
        if victim:
            revive_nodes()
            wait_for_node_state(victim, ("idle", "mixed"), timeout=60)
    resumed = resumes(run_dir)
    assert len(resumed) == 1 and Path(resumed[0]["checkpoint"]).name == Path(newest).name, resumed
    record("node_death_steps_recomputed", recomputed_steps(run_dir))
    assert all(r <= CKPT_EVERY + 1 for r in recomputed_steps(run_dir))
    # the registry knows the new attempt, and where it started from
    status = run_cli(["status", job_id, "--json"], ft_env, timeout=60)
    row = json.loads(status.stdout)["jobs"][0]
    assert row["resumes"] == 1 and row["state"] == "FAILED", row
    assert f"node(s) {victim} lost; auto-resumed as job {new_job}" in (row["reason"] or ""), row
    # ...and rolls the run up: this job failed, its run completed as the new job
    assert (row["continued_as"], row["run_state"]) == (new_job, "COMPLETED"), row
    table = run_cli(["status", job_id], ft_env, timeout=60).stdout
    assert f"FAILED -> {new_job} COMPLETED" in table, table
    assert_same_result(run_dir, reference_dir(reference))


def test_batch_host_death_requeues_the_job_which_resumes(
    ft_env: dict[str, str], reference: Background, slurm_cluster: dict[str, str]
) -> None:
    """The node running the batch script dies: nothing of the orchestrator's can act there. Slurm ends
    the attempt NODE_FAIL once it declares the node down and requeues the job (``--requeue``); the
    new attempt resumes from the last complete checkpoint. ``submit --wait`` and ``logs -f`` follow
    the same job id through it and report its real end."""
    require(
        slurm_cluster.get("ORCHESTRATOR_TEST_CLUSTER_MODE", "netns") == "netns", "needs nodes in namespaces"
    )
    runs = Path(ft_env["ORCHESTRATOR_RUNS"])
    before = set(runs.glob("*/job_id"))
    waiter = Background(["submit", *TWO_NODES_FSDP, "--wait", "--poll", "1", "--", TRAIN, *RUN_ARGS], ft_env)
    id_file = poll(
        lambda: [p for p in runs.glob("*/job_id") if p not in before], 60, "the submitted job's id"
    )[0]
    job_id, run_dir = id_file.read_text().strip(), id_file.parent
    follower = Background(["logs", job_id, "-f", "--node", "0"], ft_env)
    show = diag(job_id, run_dir)
    batch_host = ""
    try:
        poll(
            lambda: (
                (run_dir / "checkpoints" / f"step_{CKPT_EVERY:08d}" / "COMPLETE.json").exists()
                and len(trains(run_dir)) >= CKPT_EVERY + 2
            ),
            240,
            "a complete checkpoint and two more steps",
            diagnostics=show,
        )
        info = slurm("scontrol", "show", "job", job_id).stdout
        batch_host = info.split("BatchHost=")[1].split()[0]
        assert batch_host in job_nodes(job_id)
        assert kill_node_processes(batch_host, include_daemons=True)
        resumed = poll(lambda: resumes(run_dir), 240, "the requeued attempt's resume", diagnostics=show)[0]
        assert batch_host not in job_nodes(job_id) or not job_nodes(job_id)
        poll(lambda: (run_dir / "final.json").exists(), 300, "final.json", diagnostics=show)
        assert sacct_state(job_id, timeout=90) == "COMPLETED"
        waited = waiter.result(timeout=120)
        followed = follower.result(timeout=120)
    finally:
        waiter.stop()
        follower.stop()
        scancel_quietly(job_id)
        if batch_host:
            revive_nodes()
            wait_for_node_state(batch_host, ("idle", "mixed"), timeout=60)
    assert int(Path(resumed["checkpoint"]).name.split("_")[1]) % CKPT_EVERY == 0
    assert all(r <= CKPT_EVERY + 2 for r in recomputed_steps(run_dir))
    assert "NODE_FAIL" in slurm("sacct", "-nXP", "-D", "-j", job_id, "-o", "State").stdout.split()
    assert slurm_restarts(job_id) == 1
    # --wait stayed with the job through its NODE_FAIL and answered for its real end
    assert waited.returncode == 0 and f"job {job_id} ended COMPLETED" in waited.stdout, (
        waited.stdout + waited.stderr
    )
    # logs -f followed it into the requeued attempt and stopped when it ended
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "attempt=0" in followed.stdout and "attempt=1" in followed.stdout, followed.stdout[-2000:]
    assert_same_result(run_dir, reference_dir(reference))


# ----------------------------------------------------------------------------------------- 4. resharding
def test_resume_on_fewer_nodes_restores_exact_state(ft_env: dict[str, str]) -> None:
    """No periodic checkpoints (--ckpt-every 0): the only checkpoint to resume from is the one the
    cancel's SIGTERM wrote, at the step training stopped."""
    options = ["--profile", "slurm_test", "--strategy", "full_shard", "--nodes", "2", "--procs-per-node", "2"]
    job_id, run_dir = submit(ft_env, options, [*TINY, "--max-steps", str(STEPS), "--ckpt-every", "0"])
    show = diag(job_id, run_dir)
    try:
        poll(lambda: len(trains(run_dir)) >= 3, 240, "3 train steps", diagnostics=show)
        res = run_cli(["cancel", job_id], ft_env, timeout=60)  # SIGTERM: training saves, no requeue
        assert res.returncode == 0, res.stdout + res.stderr
        state = wait_for_job_state(job_id, ["CANCELLED", "FAILED", "COMPLETED"], timeout=90)
        assert state == "CANCELLED", state
    finally:
        scancel_quietly(job_id)
    assert slurm_restarts(job_id) in (0, None), "a cancelled job must not be requeued"
    assert not (run_dir / "final.json").exists()
    newest = last_complete_checkpoint(run_dir)
    stopped_at = max(e["step"] for e in trains(run_dir))
    assert newest is not None, "the cancel's SIGTERM wrote no checkpoint\n" + node_logs(run_dir)
    assert newest.step == stopped_at < STEPS, (newest, stopped_at)
    # Read now: the resumed run prunes it (--keep-last) once it has saved newer ones.
    marker = read_json(newest.path / "COMPLETE.json")
    assert marker is not None and marker["world_size"] == 4

    res = run_cli(["resume", job_id, "--nodes", "1", "--wait", "--poll", "1"], ft_env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + node_logs(run_dir)
    assert "resharding: checkpoint world size 4 -> 2" in res.stdout
    loaded = read_json(run_dir / "loaded.json")
    assert loaded is not None and loaded["world_size"] == 2
    assert Path(loaded["checkpoint"]) == newest.path and loaded["step"] == marker["step"]
    for key in ("param_checksum", "optim_checksum"):
        assert math.isclose(loaded[key], marker[key], rel_tol=1e-12, abs_tol=1e-12), (key, loaded, marker)
    final = read_json(run_dir / "final.json")
    assert final is not None and final["step"] == STEPS and final["world_size"] == 2


# ----------------------------------------------------------------------------------------- 5. own failure
def test_script_that_raises_is_not_requeued(ft_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(
        "import sys\nprint('about to fail', flush=True)\nraise SystemExit('boom: the script failed by itself')\n"
    )
    # --auto-resume too: every node still answers, so the after-step check must not resubmit.
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--nodes",
            "1",
            "--auto-resume",
            "--wait",
            "--poll",
            "0.5",
            "--",
            str(script),
        ],
        ft_env,
        timeout=180,
    )
    job_id, run_dir = job_and_dir(res.stdout)
    assert res.returncode == 1, res.stdout + res.stderr
    assert sacct_state(job_id) == "FAILED"
    status = run_cli(["status", job_id, "--json"], ft_env, timeout=60)
    row = json.loads(status.stdout)["jobs"][0]
    assert row["state"] == "FAILED" and row["requeues"] == 0, row
    assert slurm_restarts(job_id) in (0, None)
    assert [p.name for p in (run_dir / "logs").iterdir()] == ["attempt_0"]
    decisions = poll(lambda: read_decisions(run_dir), 30, "the after-step decision")
    assert [d["action"] for d in decisions] == ["none"] and decisions[0]["lost_nodes"] == [], decisions
    assert "every node still answers" in decisions[0]["reason"]


# ----------------------------------------------------------------------------------------- 2. time limit
def test_time_limit_reached_over_several_attempts(time_limit_job: dict[str, Any]) -> None:
    job_id, run_dir, max_steps = time_limit_job["job_id"], time_limit_job["run_dir"], TIME_LIMIT_STEPS
    show = diag(job_id, run_dir)
    left = TIME_LIMIT_DEADLINE_S - (time.monotonic() - time_limit_job["submitted"])
    try:
        poll(
            lambda: (run_dir / "final.json").exists(),
            max(30.0, left),
            "the time-limited job to finish",
            interval=1.0,
            diagnostics=show,
        )
        assert sacct_state(job_id, timeout=90) == "COMPLETED", show()
    finally:
        if not (run_dir / "final.json").exists():
            scancel_quietly(job_id)
    hold = time_limit_job["hold"]
    hold.join(timeout=30)
    assert not hold.is_alive() and hold.error is None, hold.error
    final = read_json(run_dir / "final.json")
    assert final is not None and final["step"] == max_steps
    attempts = sorted(int(p.name.split("_")[1]) for p in (run_dir / "logs").glob("attempt_*"))
    assert len(attempts) >= 2 and attempts == list(range(len(attempts)))
    logs = [(run_dir / "logs" / f"attempt_{a}" / "node_0.log").read_text() for a in attempts]
    # Nobody but Slurm sent a signal here: every attempt but the last was stopped by the time limit.
    assert all("SIGUSR2" in text or "SIGTERM" in text for text in logs[:-1]), logs
    assert "exit=0" in logs[-1]
    segs = segments(run_dir)
    last = 0
    for seg in segs:
        if seg["resume"] is not None:  # where the previous attempt that trained stopped
            assert seg["resume"]["step"] == last, (seg["resume"], last)
        last = max([last, *(e["step"] for e in seg["train"])])
    record("time_limit_attempts", len(attempts))
    record("time_limit_resume_steps", [s["resume"]["step"] for s in segs[1:]])
    record("time_limit_steps_recomputed", recomputed_steps(run_dir))
