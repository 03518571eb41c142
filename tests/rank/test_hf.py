"""An unchanged HF ``Trainer`` script on the ``local`` profile, through the node's script hooks (issue 27):

* stopped by ``cancel --signal USR2`` (PREEMPTED at ``checkpoint-N``), ``orchestrator resume`` continues it
  from N, and ``status`` shows the newest checkpoint, although it lives in the Trainer's ``output_dir``;
* a new run into an ``output_dir`` that holds another run's checkpoints is refused before training,
  naming that run and how to continue it; ``ORCHESTRATOR_OVERWRITE_CHECKPOINTS=1`` trains there anyway.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.contract.attempt_start import read_attempt_start
from orchestrator.contract.run_dir import read_exit_status
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, status_row

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

TRAINER = str(REPO / "examples" / "trainer_cnn.py")
ONE_NODE = ["--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--strategy", "ddp"]


def complete_checkpoints(out: Path) -> dict[int, Path]:
    return {int(p.name.split("-")[1]): p for p in out.glob("checkpoint-*") if (p / "COMPLETE.json").exists()}


def test_a_preempted_trainer_run_resumes_from_its_checkpoint_and_status_shows_it(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "trainer_out"
    args = ["--max-steps", "600", "--save-steps", "10", "--samples", "512", "--output-dir", str(out)]
    res = run_cli(["submit", *ONE_NODE, "--", TRAINER, *args], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: 20 in complete_checkpoints(out), 120, "checkpoint-20 complete")
    assert run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60).returncode == 0
    res = run_cli(["wait", job_id, "--timeout", "120"], orch_env, timeout=150)
    assert res.returncode == 1 and "PREEMPTED" in res.stdout, res.stdout + res.stderr
    stopped = read_exit_status(run_dir)
    assert stopped is not None and stopped["reason"] == "signal", stopped
    step = int(stopped["step"])
    assert step in complete_checkpoints(out), (step, sorted(complete_checkpoints(out)))
    row = status_row(orch_env, job_id)
    assert row["state"] == "PREEMPTED", row
    assert row["checkpoint_step"] == step and row["checkpoint_path"] == str(out / f"checkpoint-{step}"), row

    res = run_cli(["resume", job_id], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"resuming job {job_id} from step {step} (checkpoint-{step})" in res.stdout, res.stdout
    new_job = res.stdout.split("submitted job ")[1].split()[0]
    res = run_cli(["wait", new_job, "--timeout", "240"], orch_env, timeout=270)
    assert res.returncode == 0, res.stdout + res.stderr
    start = read_attempt_start(run_dir, 1)
    assert start is not None and start["step"] == step, start
    assert start["checkpoint"] == str(out / f"checkpoint-{step}") and start["hook"] == "trainer", start
    row = status_row(orch_env, new_job)
    assert row["state"] == "COMPLETED" and row["checkpoint_step"] == 600, row


def test_a_new_run_never_overwrites_another_runs_checkpoints(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "trainer_out"
    args = ["--max-steps", "20", "--save-steps", "10", "--samples", "256", "--output-dir", str(out)]
    res = run_cli(["submit", *ONE_NODE, "--wait", "--", TRAINER, *args], orch_env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    first_job, first_run = job_and_run_dir(res.stdout)
    before = {step: (p / "COMPLETE.json").read_bytes() for step, p in complete_checkpoints(out).items()}
    assert sorted(before) == [10, 20], sorted(before)

    res = run_cli(["submit", *ONE_NODE, "--wait", "--", TRAINER, *args], orch_env, timeout=180)
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    row = status_row(orch_env, job_id)
    assert row["state"] == "FAILED", row
    reason = row["reason"]
    assert f"output_dir {out} holds checkpoints of run {first_run.resolve()} (job {first_job})" in reason, (
        reason
    )
    full = read_exit_status(run_dir)
    assert full is not None and full["code"] == 2 and full["reason"] == "output_dir", full
    assert f"`orchestrator resume {first_job}`" in full["problems"][0], full
    assert "ORCHESTRATOR_OVERWRITE_CHECKPOINTS=1" in full["problems"][0], full
    # Refused before training: no step ran, the first run's checkpoints are untouched.
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or '"event": "train"' not in metrics.read_text()
    assert {
        step: (p / "COMPLETE.json").read_bytes() for step, p in complete_checkpoints(out).items()
    } == before

    res = run_cli(
        ["submit", *ONE_NODE, "--wait", "--", TRAINER, *args],
        {**orch_env, "ORCHESTRATOR_OVERWRITE_CHECKPOINTS": "1"},
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_reporting_service_killed_by_the_stop_signal_does_not_lose_the_agreed_save(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """TERM reaches a Trainer script's reporting service (wandb-core) with the rank, after the step's
    stop check and before the step's log: the log must not raise into the rank (issue 47, measured on
    the cluster under load: the rank died of wandb's ConnectionResetError and the save was lost)."""
    out = tmp_path / "reporter_out"
    script = str(REPO / "tests" / "scripts" / "trainer_reporter_dies.py")
    one_rank = ["--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--strategy", "ddp"]
    res = run_cli(
        ["submit", *one_rank, "--", script, "--output-dir", str(out), "--term-at", "10"], orch_env, 60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    res = run_cli(["wait", job_id, "--timeout", "120"], orch_env, timeout=150)
    assert res.returncode == 1 and "PREEMPTED" in res.stdout, res.stdout + res.stderr
    stopped = read_exit_status(run_dir)
    # The signal came after step 10's check: every rank agrees at step 11's end and saves step 11.
    assert stopped is not None and stopped["code"] == 75 and stopped["step"] == 11, stopped
    assert sorted(complete_checkpoints(out)) == [11], sorted(complete_checkpoints(out))
    # Step 10's log was kept (the Trainer's history), only the dead service was not called.
    history = json.loads((out / "checkpoint-11" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [5, 10], history
