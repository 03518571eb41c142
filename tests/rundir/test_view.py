"""A run's details as the dashboard's job page shows them (``rundir/view.py``): each attempt says
what it started from and, for a restart inside the allocation, why (issue 42)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract.restarts import append_restart
from orchestrator.rundir.view import attempts


def test_a_restarted_attempt_names_its_cause(tmp_path: Path) -> None:
    for attempt, step in ((0, None), (1, 10)):
        folder = tmp_path / "logs" / f"attempt_{attempt}"
        folder.mkdir(parents=True)
        (folder / "node_0.log").write_text("[orchestrator node] host=n1 node_rank=0/1\n")
        (folder / "node_0.exit").write_text("1" if attempt == 0 else "0")
        if step is not None:
            (folder / "start.json").write_text(json.dumps({"step": step, "checkpoint": "c", "hook": "train"}))
    append_restart(
        tmp_path, {"job_id": "7", "failed_attempt": 0, "attempt": 1, "cause": "rank 1 died of SIGKILL"}
    )
    rows = attempts(tmp_path)
    assert [(r["attempt"], r["start_step"], r["restarted_after"]) for r in rows] == [
        (0, None, None),
        (1, 10, "rank 1 died of SIGKILL"),
    ]
