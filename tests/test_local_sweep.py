"""A sweep on the local profile: no job arrays, so its tasks start K at a time on this machine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, kill_tree, poll, run_cli

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "sweep_task.py")


@pytest.fixture
def reap_sweep(tmp_path: Path) -> Iterator[None]:
    yield
    for pids in [
        *(tmp_path / "runs").glob("*/local_pids.json"),
        *(tmp_path / "runs").glob("*/task_*/local_pids.json"),
    ]:
        for pid in json.loads(pids.read_text()).values():
            kill_tree(int(pid))


def test_a_local_sweep_runs_k_tasks_at_a_time(orch_env: dict[str, str], reap_sweep: None) -> None:
    res = run_cli(
        ["sweep", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--max-parallel", "2"]
        + ["--grid", "lr=0.3,0.1,0.2", "--", SCRIPT, "--lr", "{lr}", "--steps", "3", "--step-s", "0.2"],
        orch_env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_id = res.stdout.split("submitted sweep ")[1].split()[0]
    sweep_dir = Path(res.stdout.split("sweep directory ")[1].split()[0])

    def finished() -> dict | None:
        data = json.loads(run_cli(["status", sweep_id, "--json"], orch_env).stdout)
        return data if data["counts"] == {"COMPLETED": 3} else None

    data = poll(finished, 240, "the three tasks completed", interval=1.0)
    tasks = [sweep_dir / f"task_{i}" for i in range(3)]
    assert [t["run_dir"] for t in data["tasks"]] == [str(t) for t in tasks]
    assert [t["params"] for t in data["tasks"]] == [{"lr": "0.3"}, {"lr": "0.1"}, {"lr": "0.2"}]
    assert data["best_task"] == 1 and data["queued"] == []
    # K = 2: the third task was submitted only after one of the first two had ended.
    ended = [(t / "local_state.json").stat().st_mtime for t in tasks]
    from orchestrator.registry.store import Registry

    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as registry:
        submitted = [registry.get(t["job_id"]).submitted_at for t in data["tasks"]]
    assert submitted[2] >= min(ended[0], ended[1]) - 0.01, (submitted, ended)
    for task, lr in zip(tasks, (0.3, 0.1, 0.2), strict=True):
        train = [json.loads(x) for x in (task / "metrics.jsonl").read_text().splitlines()]
        assert [(e["step"], e["lr"]) for e in train] == [(1, lr), (2, lr), (3, lr)]
