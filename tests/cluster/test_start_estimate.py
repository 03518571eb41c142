"""When will it start (issue 43 item 3): on a busy partition (every node held by another job with a
time limit), ``submit --test-only`` asks Slurm without submitting, ``submit`` prints Slurm's
estimate, ``status`` shows the pending job's estimate and reason (from its one batched query), and
once it ran, ``cost`` says how far off the estimate at submission was."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, sacct_state
from tests.helpers.slurm_cluster import require_cluster, scancel_quietly, slurm

pytestmark = pytest.mark.slow
TRAIN = str(REPO / "train" / "train.py")
ARGS = ["--preset", "tiny", "--data", "synthetic", "--max-steps", "2", "--batch-size", "2", "--seq-len", "32"]


def _later_than_now(stamp: str) -> bool:
    return datetime.fromisoformat(stamp).timestamp() > time.time() + 30


def test_a_pending_job_shows_slurms_start_estimate(
    slurm_cluster: dict[str, str], orch_env: dict[str, str], tmp_path: Path
) -> None:
    cluster = require_cluster()
    fillers = [
        slurm("sbatch", "--parsable", "-N1", "--exclusive", "--time=3", f"--output={tmp_path}/filler-%j.out",
              "--wrap", "sleep 170").stdout.strip()
        for _ in range(cluster.nodes)
    ]  # fmt: skip
    job_id = ""
    try:
        poll(
            lambda: all(
                slurm("squeue", "-h", "-j", f, "-o", "%T").stdout.strip() == "RUNNING" for f in fillers
            ),
            60,
            "the partition busy",
        )
        submit = ["submit", "--profile", "slurm_test", "--nodes", "2", "--strategy", "ddp"]
        asked = run_cli([*submit, "--test-only", "--", TRAIN, *ARGS], orch_env, timeout=60)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        assert "nothing submitted" in asked.stdout and "submitted job" not in asked.stdout, asked.stdout
        stamp = asked.stdout.split(" to start at ")[1].split()[0]
        assert _later_than_now(stamp), asked.stdout
        res = run_cli([*submit, "--", TRAIN, *ARGS], orch_env, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        job_id, _ = job_and_run_dir(res.stdout)
        said = res.stdout.split("start estimate: ")[1].split()[0]
        assert _later_than_now(said), res.stdout

        def row() -> dict | None:
            shown = run_cli(["status", job_id, "--json"], orch_env, timeout=60)
            found = json.loads(shown.stdout)["jobs"][0]
            return found if found.get("start_estimate") else None

        pending = poll(row, 60, "Slurm's estimate in status")
        assert pending["state"] == "PENDING" and _later_than_now(pending["start_estimate"]), pending
        table = run_cli(["status", job_id], orch_env, timeout=60).stdout
        assert f"{job_id} PENDING (" in table and "expects it to start at" in table, table
        # The partition frees up early: the job starts, and `cost` says how far off the estimate was.
        for f in fillers:
            scancel_quietly(f)
        assert sacct_state(job_id, timeout=240) == "COMPLETED"
        bill = run_cli(["cost", job_id], orch_env, timeout=60)
        assert bill.returncode == 0, bill.stdout + bill.stderr
        assert (
            f"job {job_id}: the scheduler's start estimate at submission was {said}; it started"
            in bill.stdout
        )
        assert "s earlier" in bill.stdout, bill.stdout
    finally:
        for j in [*fillers, job_id]:
            if j:
                scancel_quietly(j)
