"""One name for a run (issue 44 item 2): its first job's id. A run that goes on in a new job (here a
``resume`` on the local profile; on Slurm a requeue as a new job, tests/cluster/test_requeue.py) is
followed by ``logs -f``, ``wait``, ``cancel`` and the API under that name, and its script reads the
same name in every attempt (``$ORCHESTRATOR_RUN_NAME``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator
from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

SWEEP_TASK = str(REPO / "tests" / "scripts" / "sweep_task.py")


def test_logs_wait_cancel_and_the_api_follow_the_run_by_its_first_name(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    task = [SWEEP_TASK, "--steps", "6", "--step-s", "0.1", "--hold-lr", "0.1", "--hold-at", "3"]
    res = run_cli(["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--", *task],
                  orch_env, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    first, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: (run_dir / "holding.json").exists(), 120, "the first attempt to hold at step 3")
    assert run_cli(["cancel", first, "--signal", "USR2"], orch_env, timeout=60).returncode == 0
    assert "PREEMPTED" in run_cli(["wait", first, "--timeout", "120"], orch_env, timeout=150).stdout

    res = run_cli(["resume", first], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    second = res.stdout.split("submitted job ")[1].split()[0]
    assert second != first
    # Followed by the first name: the follow ends with the run (the second job), not with the first
    # job's PREEMPTED, which a follow of the job alone would report at once (exit 1).
    follow = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", "-f", first],
        env=orch_env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert follow.returncode == 0, follow.stdout + follow.stderr
    waited = run_cli(["wait", first, "--timeout", "60"], orch_env, timeout=90)
    assert waited.returncode == 0 and f"the run continues as job {second}" in waited.stdout, waited.stdout
    job = orchestrator.get_job(first, home=orch_env["ORCHESTRATOR_HOME"])
    row = job.status()
    assert (row.continued_as, row.run_state and row.run_state.value) == (second, "COMPLETED"), row
    assert job.wait(timeout=30).value == "COMPLETED"
    # The script read one name in both attempts; the second node's log says it too.
    assert (run_dir / "run_names.txt").read_text().split() == [first, first]
    assert f"job={second} run={first} " in (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
    # `cancel` by the first name acts on the run's newest job (here already over: it says which).
    refused = run_cli(["cancel", first], orch_env, timeout=60)
    assert refused.returncode == 2 and f"job {second} already ended (COMPLETED)" in refused.stderr, (
        refused.stderr
    )
