"""Local jobs beside each other and a cancel that ends them (issue 27, items 6 and 13).

``cancel`` of a local job whose rank does not stop on SIGTERM escalates to SIGKILL after the grace
(Slurm's KillWait; ``ORCHESTRATOR_LOCAL_KILL_WAIT_S`` here) and the job reads CANCELLED. Two local
jobs from two registries (both ``local-1``) each hold a port of their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, kill_tree, poll, run_cli, status_row, submit_local

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "stray_child.py")


@pytest.fixture
def reap(tmp_path: Path) -> Iterator[None]:
    yield
    for pids in tmp_path.glob("runs*/*/local_pids.json"):
        for pid in json.loads(pids.read_text()).values():
            kill_tree(int(pid))
    for ranks in tmp_path.glob("runs*/*/logs/attempt_*/node_*_ranks/rank_pids.json"):
        record = json.loads(ranks.read_text())
        for pid in [record["launcher"], *record["ranks"].values()]:
            kill_tree(int(pid))


def _submit(env: dict[str, str], *script_args: str, nodes: int = 1) -> tuple[str, Path]:
    return submit_local(env, SCRIPT, *script_args, nodes=nodes)


def _trained(run_dir: Path, nodes: int) -> bool:
    """Every node's ranks forked, and every rank has written a step."""
    metrics = run_dir / "metrics.jsonl"
    if len(list(run_dir.glob("logs/attempt_0/node_*_ranks/rank_pids.json"))) < nodes or not metrics.exists():
        return False
    ranks = {json.loads(line).get("rank") for line in metrics.read_text().splitlines() if line.strip()}
    return len(ranks) >= nodes


def test_cancel_escalates_to_sigkill_after_the_grace_and_reads_cancelled(
    orch_env: dict[str, str], reap: None
) -> None:
    """Before: SIGTERM only; a rank that does not stop on it kept the job RUNNING for good."""
    env = {**orch_env, "ORCHESTRATOR_LOCAL_KILL_WAIT_S": "2"}
    job_id, run_dir = _submit(env, "--ignore-term")
    poll(lambda: _trained(run_dir, 1), 120, "training")
    res = run_cli(["cancel", job_id], env)
    assert res.returncode == 0, res.stdout + res.stderr
    row = poll(lambda: (r := status_row(env, job_id))["terminal"] and r, 40, "the cancelled job ended")
    assert row["state"] == "CANCELLED", row
    log = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "still running 2 s after SIGTERM: killing it" in log, log


def test_two_registries_local_jobs_each_hold_a_free_port(
    orch_env: dict[str, str], tmp_path: Path, reap: None
) -> None:
    """Before: both registries' ``local-1`` derived port 29614 and the second failed at once ("another
    process is utilizing it")."""
    other = {
        **orch_env,
        "ORCHESTRATOR_HOME": str(tmp_path / "home2"),
        "ORCHESTRATOR_RUNS": str(tmp_path / "runs2"),
    }
    first, first_dir = _submit(orch_env, nodes=2)
    second, second_dir = _submit(other, nodes=2)
    assert first == second == "local-1"
    for env, job_id, run_dir in ((orch_env, first, first_dir), (other, second, second_dir)):
        poll(
            lambda run_dir=run_dir: _trained(run_dir, 2),
            180,
            f"{run_dir.name}: both nodes training",
            diagnostics=lambda run_dir=run_dir: "\n".join(
                p.read_text()[-2000:] for p in run_dir.glob("logs/attempt_0/node_*.log")
            ),
        )
        assert not status_row(env, job_id)["terminal"]
    ports = [
        json.loads((d / "logs/attempt_0/rendezvous_port").read_text())["port"]
        for d in (first_dir, second_dir)
    ]
    assert ports[0] != ports[1], ports
    for env, job_id in ((orch_env, first), (other, second)):
        assert run_cli(["cancel", job_id], env).returncode == 0
