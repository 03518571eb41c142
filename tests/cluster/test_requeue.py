"""Requeue on the real cluster, through the orchestrator's own commands: ``cancel --signal`` asks for a
checkpoint and a requeue, ``--max-requeues`` bounds them, and the node entry's relay alone brings a
stop signal to every training process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import REPO, kill_tree, poll, run_cli, sacct_state
from tests.helpers.run_dirs import events
from tests.helpers.slurm_cluster import slurm

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]
#: Far more steps than the test lets run: the job only ends by the signals the test sends.
LONG = [*TINY, "--max-steps", "100000", "--ckpt-every", "1000"]


def submit(env: dict[str, str], *options: str) -> tuple[str, Path]:
    res = run_cli(["submit", "--profile", "slurm_test", *options, "--", TRAIN, *LONG], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split("submitted job ")[1].split()[0], Path(
        res.stdout.split("run directory ")[1].split()[0]
    )


def restarts(job_id: str) -> int:
    out = slurm("scontrol", "show", "job", job_id, check=False).stdout
    return next((int(w.split("=", 1)[1]) for w in out.split() if w.startswith("Restarts=")), 0)


def test_cancel_signal_requeues_until_max_requeues_then_stops(slurm_cluster: dict, orch_env: dict) -> None:
    job_id, run_dir = submit(orch_env, "--nodes", "2", "--max-requeues", "1")
    try:
        poll(lambda: len(events(run_dir, "train")) >= 3, 240, "3 train steps")
        sent = run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60)
        assert sent.returncode == 0 and "sent SIGUSR2" in sent.stdout, sent.stdout + sent.stderr
        first = poll(lambda: events(run_dir, "resume"), 180, "the resume after the first USR2")[0]
        stopped_at = max(e["step"] for e in events(run_dir, "train") if e["time"] < first["time"])
        assert first["step"] == stopped_at  # checkpointed the step it stopped at: no step lost
        poll(
            lambda: [e for e in events(run_dir, "train") if e["step"] > first["step"]], 120, "a resumed step"
        )

        again = run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60)
        assert again.returncode == 0, again.stdout + again.stderr
        state = sacct_state(job_id, timeout=180)
    finally:
        slurm("scancel", job_id, check=False)
    # The bound: one requeue happened, the second request checkpointed but was not requeued.
    assert state == "FAILED" and restarts(job_id) == 1
    assert len(events(run_dir, "resume")) == 1
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert (
        status["code"] == 75
        and (run_dir / "checkpoints" / f"step_{status['step']:08d}" / "COMPLETE.json").exists()
    )
    err = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    assert "not requeued: 1 requeues reached max_requeues" in err
    assert sorted(p.name for p in (run_dir / "logs").glob("attempt_*")) == ["attempt_0", "attempt_1"]


def test_the_node_entry_relays_a_stop_signal_to_every_worker(slurm_cluster: dict, orch_env: dict) -> None:
    """Only the node entry point is signalled (not the step, not the workers): its relay must reach
    both training processes of the node, each of which says so in its own log."""
    job_id, run_dir = submit(orch_env, "--nodes", "1", "--procs-per-node", "2", "--max-requeues", "0")
    try:
        poll(lambda: len(events(run_dir, "train")) >= 3, 240, "3 train steps")
        launcher = int((run_dir / "logs" / "attempt_0" / "node_0.pid").read_text())
        node_entry = psutil.Process(launcher).parent()
        assert node_entry is not None and "submitit.core._submit" in " ".join(node_entry.cmdline())
        # The launcher's own children (ranks forked by the direct launcher show the script's command).
        workers = [p for p in psutil.Process(launcher).children() if TRAIN in " ".join(p.cmdline())]
        assert len(workers) == 2
        os.kill(node_entry.pid, signal.SIGUSR2)
        state = sacct_state(job_id, timeout=180)
    finally:
        slurm("scancel", job_id, check=False)
    assert state == "FAILED"  # checkpointed on the signal; max_requeues 0 keeps it from coming back
    node_log = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "relayed SIGUSR2 to 2 process(es)" in node_log and "exit=75" in node_log
    heard = {
        rank
        for path in (run_dir / "logs" / "attempt_0" / "node_0_ranks").glob("rank_*.log")
        for rank in ("0", "1")
        if f"[rank {rank}] received SIGUSR2" in path.read_text()
    }
    assert heard == {"0", "1"}
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 75


def test_requeue_as_new_job_continues_the_run_in_a_successor(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    """``requeue_as: new_job``: a stop signal hands the run to a successor job (new id, no
    ``scontrol requeue``, so no cred_expire hold) that resumes at the step the first one stopped at;
    the run stays one run in the registry and status, and keeps one name (the first job's id) for
    ``status``, ``logs -f``, ``cancel``, ``wait`` and the script; ``max_requeues`` bounds the
    successors."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    text = (REPO / "cluster_profiles" / "slurm_test.yaml").read_text()
    (profiles / "slurm_test.yaml").write_text(text + "requeue_as: new_job\n")
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "2",
         "--max-requeues", "1", "--", TRAIN, *LONG],
        orch_env, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    successor = ""
    try:
        poll(lambda: len(events(run_dir, "train")) >= 3, 240, "3 train steps")
        sent = run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        first = poll(lambda: events(run_dir, "resume"), 180, "the successor's resume")[0]
        successor = (run_dir / "job_id").read_text().strip()
        stopped_at = max(e["step"] for e in events(run_dir, "train") if e["time"] < first["time"])
        assert first["step"] == stopped_at  # checkpointed the step it stopped at: no step lost
        assert sacct_state(job_id, timeout=120) == "COMPLETED" and restarts(job_id) == 0  # handed over
        status = run_cli(["status", job_id, "--json"], orch_env, timeout=60)
        row = json.loads(status.stdout)["jobs"][0]
        assert (row["continued_as"], row["run_state"]) == (successor, "RUNNING"), row
        assert f"continued as job {successor}" in (row["reason"] or ""), row
        # One name for the run: the first job's id. Its log follow goes on into the successor's
        # attempt; the signal sent by that name reaches the successor.
        follow = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "logs", "-f", job_id],
            env=orch_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # The bound: a second stop checkpoints but hands over to no third job.
            again = run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60)
            assert again.returncode == 0, again.stdout + again.stderr
            assert f"the run continues as job {successor}" in again.stdout, again.stdout
            assert sacct_state(successor, timeout=180) == "FAILED"
            followed, _ = follow.communicate(timeout=120)
        finally:
            kill_tree(follow.pid)
        # It ended with the run (FAILED: no third job), not with the first job (COMPLETED, exit 0),
        # and printed the successor's node log to its last line.
        assert follow.returncode == 1 and "node_rank=0 exit=" in followed, followed[-3000:]
        node_log = (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
        assert f"job={successor} run={job_id} " in node_log  # the script's $ORCHESTRATOR_RUN_NAME
        waited = run_cli(["wait", job_id, "--timeout", "60"], orch_env, timeout=90)
        assert waited.returncode == 1 and f"the run continues as job {successor}" in waited.stdout, (
            waited.stdout
        )
    finally:
        slurm("scancel", job_id, check=False)
        if successor:
            slurm("scancel", successor, check=False)
    assert successor not in ("", job_id)
    listed = json.loads(run_cli(["list", "--json"], orch_env, timeout=60).stdout)
    assert sorted(j["job_id"] for j in listed if j["run_dir"] == str(run_dir)) == sorted([job_id, successor])
    decisions = [json.loads(line) for line in (run_dir / "auto_resume.jsonl").read_text().splitlines()]
    assert [d["action"] for d in decisions] == ["resubmitted", "refused"], decisions
    assert "1 requeues reached max_requeues" in decisions[1]["reason"]
    assert sorted(p.name for p in (run_dir / "logs").glob("attempt_*")) == ["attempt_0", "attempt_1"]
