"""One budget for a whole sweep on the local profile (issue 45, orchestrator.runner.local_sweep with
orchestrator.config.sweep_budget): a sweep of 3 tasks with a budget for ~2.4 of them runs 2 and
refuses the third with the reason (``status SWEEP``, ``wait SWEEP``), each started task ran under a
cap of its own that kept the sweep within its budget, and the sweep's ``cost`` is the sum of its
tasks' and within the budget.

The tasks are tests/scripts/sweep_task.py (real training through ``orchestrator.loop``), 30 steps paced
to end 20 s after the task's node started and a checkpoint every 5 (what each task's cap measures its
next checkpoint interval by): ~21 CPU-seconds a task (20.7 and 21.0 at load 12 on 2 cores) however
long the start-up took (on plain sleeping steps a task cost 13 s on a quiet machine, 35 s at load
14). A budget of 55 CPU-seconds (2.4 such tasks) gives this outcome for any task cost from 18.4 s
(three would fit) to 27 s (two would not).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.config.budget import parse_budget
from tests.helpers.cli import REPO, kill_tree, run_cli

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "sweep_task.py")
#: Each task's script trains for this long (its steps paced to end then, whatever its start-up took).
PACE_S = 20
#: ~2.4 tasks of ~21-23 CPU-seconds (one process, one CPU: the paced 20 s and the node's exit).
BUDGET = "0.0153cpu-h"


def test_a_sweep_budget_runs_what_it_covers_and_refuses_the_rest(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    res = run_cli(
        ["sweep", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--max-parallel", "1",
         "--budget", BUDGET, "--grid", "lr=0.3,0.1,0.2", "--wait", "--",
         SCRIPT, "--lr", "{lr}", "--steps", "30", "--pace-s", str(PACE_S), "--save-every", "5"],
        orch_env, timeout=300,
    )  # fmt: skip
    try:
        assert res.returncode == 1, res.stdout + res.stderr
        sweep_id = res.stdout.split("submitted sweep ")[1].split()[0]
        assert f"sweep {sweep_id} ended BUDGET" in res.stdout, res.stdout
        status = json.loads(run_cli(["status", sweep_id, "--json"], orch_env, timeout=60).stdout)
        table = run_cli(["status", sweep_id], orch_env, timeout=60).stdout
        bill = json.loads(run_cli(["cost", sweep_id, "--json"], orch_env, timeout=60).stdout)
        tasks = [json.loads(run_cli(["cost", t["job_id"], "--json"], orch_env, timeout=60).stdout)
                 for t in status["tasks"]]  # fmt: skip
    finally:
        for pids in (tmp_path / "runs").rglob("local_pids.json"):
            for pid in json.loads(pids.read_text()).values():
                kill_tree(int(pid))

    # Two tasks ran to their end; the third was refused, never started, with the figures.
    assert status["counts"] == {"COMPLETED": 2, "BUDGET": 1}, status
    assert [t["task"] for t in status["tasks"]] == [0, 1] and status["queued"] == [], status
    (refused,) = status["refused"]
    assert (refused["task"], refused["params"], refused["state"]) == (2, {"lr": "0.2"}, "BUDGET"), refused
    m = re.fullmatch(r"refused: budget left (\S+) cpu-h < a task's measured (\S+) cpu-h", refused["reason"])
    assert m is not None, refused
    left, measured = float(m.group(1)), float(m.group(2))
    assert 0 <= left < measured, refused
    assert re.search(r"\n2 +- +lr=0\.2 +BUDGET .*refused: budget left", table), table

    # Each task ran under a cap of its own: the first the whole budget (nothing measured, one slot),
    # the second what the first left; the caps and what was spent keep the sweep within the budget.
    spent = [t["budget_spent"] for t in status["tasks"]]
    caps = [parse_budget(t["budget"]).amount for t in status["tasks"]]
    total = parse_budget(BUDGET).amount
    assert caps[0] == total and caps[1] <= total - spent[0] and caps[1] >= spent[1], (caps, spent)
    assert measured == pytest.approx(max(spent), abs=1e-4) and left == pytest.approx(
        total - sum(spent), abs=1e-4
    )

    # The sweep's bill is its tasks' bills added up, and within its budget.
    assert [t["task"] for t in bill["tasks"]] == [0, 1], bill
    assert bill["allocated_hours"] == pytest.approx(sum(t["allocated_hours"] for t in tasks), abs=2e-6), bill
    assert bill["allocated_hours"] <= total, (bill["allocated_hours"], total)
    print(
        f"sweep budget {total * 3600:.1f} cpu-s: tasks spent {spent[0] * 3600:.1f} and {spent[1] * 3600:.1f} "
        f"cpu-s (caps {caps[0] * 3600:.1f}, {caps[1] * 3600:.1f}); bill {bill['allocated_hours'] * 3600:.1f} cpu-s"
    )
