"""``--budget`` on the local profile, end to end (orchestrator.node.budget_watch): a real job of
``train/`` with a budget of under 30 CPU-seconds stops at a complete checkpoint within one checkpoint
interval of it, ``status`` says BUDGET and why, a resume without more budget is refused, and
``resume --budget MORE`` continues it to the same losses as an uninterrupted run (started beside it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.contract.attempt_start import ENDED_IN_START_UP
from orchestrator.contract.run_dir import last_complete_checkpoint
from tests.helpers import train_launch as tl
from tests.helpers.cli import REPO, job_and_run_dir, run_cli, status_row

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

TRAIN = str(REPO / "train" / "train.py")
STEPS, EVERY = 800, 10
ARGS = [TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", str(STEPS), "--ckpt-every", str(EVERY),
        "--log-every", "1"]  # fmt: skip
ONE = ["--profile", "local", "--nodes", "1", "--procs-per-node", "1"]
#: 28.8 CPU-seconds on one CPU: start-up (~4 s alone, over 14 s once on a loaded machine: the first
#: attempt then stopped in start-up, before any checkpoint) and a part of the 800 steps (~34 s alone).
BUDGET_H = 0.008
BUDGET = f"{BUDGET_H}cpu-h"


def _held(run_dir: Path) -> list[dict]:
    """Every attempt's node records: what ``cost`` bills a local job by."""
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("logs/attempt_*/node_*.held.json"))]


def test_a_budget_stops_at_a_checkpoint_and_resume_with_more_continues_exactly(
    orch_env: dict[str, str],
) -> None:
    reference = run_cli(["submit", *ONE, "--", *ARGS], orch_env)  # uninterrupted, beside the budgeted run
    assert reference.returncode == 0, reference.stdout + reference.stderr
    ref_id, ref_dir = job_and_run_dir(reference.stdout)

    res = run_cli(["submit", *ONE, "--budget", BUDGET, "--wait", "--poll", "0.5", "--", *ARGS], orch_env, 240)
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    assert json.loads((run_dir / "job.json").read_text())["budget"] == BUDGET  # the resolved config keeps it

    row = status_row(orch_env, job_id)
    assert row["state"] == "BUDGET", row
    assert row["reason"].startswith("budget: spent ") and f"of {BUDGET}" in row["reason"], row
    assert row["budget"] == BUDGET and 0 < row["budget_spent"] < BUDGET_H, row
    table = run_cli(["status", job_id], orch_env).stdout
    assert f"{job_id} BUDGET: budget: spent" in table, table
    stop = json.loads((run_dir / "exit_status.json").read_text())
    checkpoint = last_complete_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.step == stop["step"] < STEPS, (checkpoint, stop)

    # Within one checkpoint interval of the budget, as cost bills it (the node's own span x its CPU).
    held = _held(run_dir)
    spent_s = sum((h["end"] - h["start"]) * h["cpus"] for h in held)
    marks = sorted((p / "COMPLETE.json").stat().st_mtime for p in (run_dir / "checkpoints").glob("step_*"))
    interval_s = max(b - a for a, b in zip(marks, marks[1:], strict=False)) if len(marks) > 1 else 0.0
    budget_s = BUDGET_H * 3600
    print(f"budget {budget_s:.1f} cpu-s, spent {spent_s:.1f} cpu-s, checkpoint interval {interval_s:.2f} s, "
          f"stopped at step {stop['step']}")  # fmt: skip
    assert spent_s <= budget_s + max(interval_s, 1.0), (spent_s, budget_s, interval_s)
    # the meter node 0 decided by and the bill agree (the same span; the bill's ends after the peers' wait)
    assert abs(row["budget_spent"] * 3600 - spent_s) <= 2.0, (row["budget_spent"] * 3600, spent_s)

    refused = run_cli(["resume", job_id], orch_env)
    assert refused.returncode == 2 and "resume --budget MORE" in refused.stderr, (
        refused.stdout + refused.stderr
    )
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    # Two CPU-seconds more run out while the resumed attempt is still starting (torch's import alone
    # takes longer): its ranks are ended at once, before they load anything, not left to start up,
    # restore and save the checkpoint they came from. The run stands where it stood.
    spent_before_s = row["budget_spent"] * 3600
    short = f"{(spent_before_s + 2.0) / 3600:.6f}cpu-h"
    started_up = run_cli(["resume", job_id, "--budget", short, "--wait", "--poll", "0.5"], orch_env, 240)
    assert started_up.returncode == 1, started_up.stdout + started_up.stderr
    second = started_up.stdout.split("submitted job ")[1].split()[0]
    row = status_row(orch_env, second)
    assert row["state"] == "BUDGET" and row["reason"].startswith("budget: spent "), row
    assert f"at step {stop['step']};" in row["reason"], row  # where the run stands, not a new step
    assert row["started_from"] == ENDED_IN_START_UP, row  # not "the script has no checkpoint hook"
    assert last_complete_checkpoint(run_dir) == checkpoint
    assert not (run_dir / "logs" / "attempt_1" / "start.json").exists()  # rank 0 never restored
    node_log = (run_dir / "logs" / "attempt_1" / "node_0.log").read_text()
    assert "stopped during start-up, before it trained: its ranks end now" in node_log, node_log
    total_s = sum((h["end"] - h["start"]) * h["cpus"] for h in _held(run_dir))
    print(f"stopped in start-up: spent {total_s:.1f} of {spent_before_s + 2.0:.1f} cpu-s")
    assert total_s <= spent_before_s + 2.0 + 1.0, (total_s, spent_before_s)

    more = run_cli(["resume", second, "--budget", "1cpu-h", "--wait", "--poll", "0.5"], orch_env, 240)
    assert more.returncode == 0, more.stdout + more.stderr
    waited = run_cli(["wait", ref_id], orch_env, 240)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    # one budget over both attempts: the resumed one metered on top of the first's record
    after = status_row(orch_env, second)
    assert after["budget"] == "1cpu-h" or status_row(orch_env, after["continued_as"])["budget"] == "1cpu-h"
    assert sorted(p.parent.name for p in run_dir.glob("logs/attempt_*/budget.json")) == [
        "attempt_0",
        "attempt_1",
        "attempt_2",
    ]
    assert (ref_dir / "logs" / "attempt_0" / "budget.json").exists()  # metered without a budget too
    ours, theirs = tl.losses(run_dir), tl.losses(ref_dir)
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    assert [s for s in theirs if ours[s] != theirs[s]] == [], "losses differ from the uninterrupted run"
