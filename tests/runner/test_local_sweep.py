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


def _sweep_json(env: dict[str, str], sweep_id: str) -> dict:
    res = run_cli(["status", sweep_id, "--json"], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def test_kill_9_of_the_sweep_starter_strands_no_task(orch_env: dict[str, str], reap_sweep: None) -> None:
    """Issue 35 item 3: ``kill -9`` of the detached starter while task 0 runs (K = 1). The tasks it
    never started are FAILED with the reason (not QUEUED forever), the counts say 3 tasks,
    ``resume SWEEP --failed`` starts them, and every task trains each step once."""
    import psutil

    res = run_cli(
        ["sweep", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--max-parallel", "1"]
        + ["--grid", "lr=0.3,0.1,0.2", "--", SCRIPT, "--lr", "{lr}", "--steps", "12", "--step-s", "0.3"],
        orch_env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_id = res.stdout.split("submitted sweep ")[1].split()[0]
    sweep_dir = Path(res.stdout.split("sweep directory ")[1].split()[0])
    starter = psutil.Process(json.loads((sweep_dir / "local_pids.json").read_text())["controller"])
    poll(lambda: _sweep_json(orch_env, sweep_id)["tasks"], 120, "task 0 started", interval=0.2)
    starter.kill()
    starter.wait(timeout=10)

    data = _sweep_json(orch_env, sweep_id)
    assert data["queued"] == [], data
    assert data["counts"].get("FAILED", 0) + data["counts"].get("COMPLETED", 0) >= 2, data["counts"]
    assert sum(data["counts"].values()) == 3, data["counts"]
    unstarted = data["not_started"]
    assert [t["task"] for t in unstarted] == [1, 2], data
    assert all("starter" in t["reason"] and "resume" in t["reason"] for t in unstarted), unstarted
    text = run_cli(["status", sweep_id], orch_env, timeout=60).stdout
    assert f"sweep {sweep_id}: 3 tasks" in text, text
    assert "waiting for a free slot" not in text, text
    listed = run_cli(["list", "--sweeps", "--json"], orch_env, timeout=60)
    assert [s["task_count"] for s in json.loads(listed.stdout) if s["sweep_id"] == sweep_id] == [3]
    table = run_cli(["list", "--sweeps"], orch_env, timeout=60).stdout.splitlines()
    row = next(line.split() for line in table if line.startswith(sweep_id))
    assert row[2] == "3", table

    resumed = run_cli(["resume", sweep_id, "--failed"], orch_env, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "task 1" in resumed.stdout and "task 2" in resumed.stdout, resumed.stdout
    data = poll(
        lambda: (d := _sweep_json(orch_env, sweep_id))["counts"] == {"COMPLETED": 3} and d,
        300,
        "the three tasks completed after resume --failed",
        interval=1.0,
        diagnostics=lambda: (sweep_dir / "sweep.log").read_text(),
    )
    assert [t["task"] for t in data["tasks"]] == [0, 1, 2] and data["not_started"] == []
    for i, lr in enumerate((0.3, 0.1, 0.2)):
        lines = (sweep_dir / f"task_{i}" / "metrics.jsonl").read_text().splitlines()
        train = [json.loads(x) for x in lines if json.loads(x).get("event", "train") == "train"]
        assert [(e["step"], e["lr"]) for e in train] == [(s, lr) for s in range(1, 13)], i


def test_sweep_wait_and_wait_sweep_give_the_outcome(orch_env: dict[str, str], reap_sweep: None) -> None:
    """``sweep --wait`` follows every task to its end: exit 0 when all completed; ``wait SWEEP`` of a
    sweep with a failed task exits 1, and 124 when its ``--timeout`` passes first."""
    base = ["sweep", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--max-parallel", "2"]
    ok = run_cli(
        [
            *base,
            "--wait",
            "--grid",
            "lr=0.3,0.1",
            "--",
            SCRIPT,
            "--lr",
            "{lr}",
            "--steps",
            "2",
            "--step-s",
            "0.1",
        ],
        orch_env,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ended COMPLETED" in ok.stdout and "2 tasks (2 COMPLETED)" in ok.stdout, ok.stdout
    # one task of two fails at once; the other runs long enough for a --timeout to pass first
    bad = run_cli(
        [*base, "--grid", "fail=yes,no", "--", SCRIPT, "--lr", "0.1", "--steps", "20", "--step-s", "0.3",
         "--fail-if", "{fail}"],
        orch_env,
        timeout=120,
    )  # fmt: skip
    assert bad.returncode == 0, bad.stdout + bad.stderr
    sweep_id = bad.stdout.split("submitted sweep ")[1].split()[0]
    early = run_cli(["wait", sweep_id, "--timeout", "1", "--poll", "0.5"], orch_env, timeout=120)
    assert early.returncode == 124 and f"sweep {sweep_id} still running" in early.stderr, early.stderr
    done = run_cli(["wait", sweep_id, "--poll", "0.5"], orch_env, timeout=300)
    assert done.returncode == 1 and f"sweep {sweep_id} ended FAILED" in done.stdout, done.stdout
    assert "1 COMPLETED, 1 FAILED" in done.stdout, done.stdout
