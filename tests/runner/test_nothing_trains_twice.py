"""Nothing trains twice, and no state goes backwards (issue 35, items 1 and 2), on the local profile.

Real jobs, real signals: ``kill -9`` of the job's controller or of a node's launcher must take every
rank with it, ``status`` must not call the job ended while a process of it lives, and ``resume`` must
refuse while one does, naming its pid. A job that ended stays ended when its run directory goes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import (
    REPO,
    job_and_run_dir,
    kill_tree,
    living_pids,
    poll,
    run_cli,
    status_row,
    submit_local,
    user_profile_dir,
)

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "scripts" / "stray_child.py")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[int]]:
    """Pids this test started outside a job (strays it made): killed on teardown, with every job."""
    extra: list[int] = []
    yield extra
    for pids in (tmp_path / "runs").glob("*/local_pids.json"):
        for pid in json.loads(pids.read_text()).values():
            kill_tree(int(pid))
    for ranks in (tmp_path / "runs").glob("*/logs/attempt_*/node_*_ranks/rank_pids.json"):
        record = json.loads(ranks.read_text())
        for pid in [record["launcher"], *record["ranks"].values()]:
            kill_tree(int(pid))
    for stray in (tmp_path / "runs").glob("*/stray.pid"):
        kill_tree(int(stray.read_text()))
    for pid in extra:
        kill_tree(pid)


def _submit(env: dict[str, str], *script_args: str, nodes: int = 2) -> tuple[str, Path]:
    return submit_local(env, SCRIPT, *script_args, nodes=nodes)


def _training(run_dir: Path, nodes: int) -> dict[str, list[int]] | None:
    """``{"launchers", "ranks"}`` once every node's ranks are forked and one has trained a step."""
    records = sorted(run_dir.glob("logs/attempt_0/node_*_ranks/rank_pids.json"))
    metrics = run_dir / "metrics.jsonl"
    if len(records) < nodes or not metrics.exists() or not metrics.read_text().strip():
        return None
    found: dict[str, list[int]] = {"launchers": [], "ranks": []}
    for path in records:
        record = json.loads(path.read_text())
        found["launchers"].append(int(record["launcher"]))
        found["ranks"].extend(int(p) for p in record["ranks"].values())
    return found


def _ends_only_when_ranks_are_gone(env: dict[str, str], job_id: str, ranks: list[int]) -> dict:
    """Poll until the job reads ended; at every look where it does, no rank may be alive."""

    def ended() -> dict | None:
        row = status_row(env, job_id)
        if row["terminal"]:  # then gone already when status looked: alive after it, they were then too
            living = living_pids(ranks)
            assert living == [], f"{row['state']} while {living} train"
            return row
        return None

    row = poll(
        ended, 60, f"job {job_id} ended", interval=0.5, diagnostics=lambda: f"alive: {living_pids(ranks)}"
    )
    assert living_pids(ranks) == []
    return row


@pytest.mark.parametrize("victim", ["controller", "launcher"])
def test_kill_9_of_a_local_jobs_controller_or_launcher_leaves_no_rank_training(
    orch_env: dict[str, str], started: list[int], victim: str
) -> None:
    """Before: the controller's kill left the submitit tasks, launchers and ranks training under
    PPID 1 while ``status`` said FAILED; the launcher's left its ranks training."""
    job_id, run_dir = _submit(orch_env)
    pids = poll(lambda: _training(run_dir, 2), 120, "both nodes training")
    target = (
        json.loads((run_dir / "local_pids.json").read_text())["controller"]
        if victim == "controller"
        else pids["launchers"][1]
    )
    os.kill(target, signal.SIGKILL)
    row = _ends_only_when_ranks_are_gone(orch_env, job_id, pids["ranks"] + pids["launchers"])
    assert row["state"] == "FAILED"


def test_kill_9_of_a_torchrun_agent_takes_its_workers(
    orch_env: dict[str, str], started: list[int], tmp_path: Path
) -> None:
    """``launcher: torchrun``: torchrun's agent runs in the node's
    launcher and starts each rank as a fresh interpreter. Before: ``kill -9`` of it left both workers
    training under PID 1, holding no lock, while ``status`` called the job FAILED. Now each worker
    takes the run's lock and dies with its parent (the node site's ``sitecustomize``)."""
    profiles = user_profile_dir(tmp_path, "local", launcher="torchrun", rdzv_backend="c10d")
    env = {**orch_env, "ORCHESTRATOR_PROFILES": str(profiles)}
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--", SCRIPT], env
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    controller = psutil.Process(json.loads((run_dir / "local_pids.json").read_text())["controller"])

    def workers() -> tuple[int, list[int]] | None:
        if not (run_dir / "metrics.jsonl").exists():
            return None
        tree = controller.children(recursive=True)
        ranks = [p for p in tree if "stray_child.py" in " ".join(p.cmdline())]
        if len(ranks) < 2:
            return None
        assert "launcher_shim" in " ".join(ranks[0].parent().cmdline()), ranks[0].parent().cmdline()
        return ranks[0].ppid(), [p.pid for p in ranks]

    agent, ranks = poll(workers, 120, "both torchrun workers training")
    started.extend(ranks)
    os.kill(agent, signal.SIGKILL)
    row = _ends_only_when_ranks_are_gone(env, job_id, ranks)
    assert row["state"] == "FAILED", row


def test_resume_refuses_while_a_process_of_the_run_lives_and_names_it(
    orch_env: dict[str, str], started: list[int]
) -> None:
    """A process the script left behind (a fork of rank 0) outlives the job's kill: the job is not
    ended while it lives, and ``resume`` says which pid trains on."""
    job_id, run_dir = _submit(orch_env, "--leave-child", nodes=1)
    pids = poll(lambda: _training(run_dir, 1), 120, "training")
    stray = int(
        poll(lambda: (run_dir / "stray.pid").exists() and (run_dir / "stray.pid").read_text(), 30, "stray")
    )
    started.append(stray)
    os.kill(json.loads((run_dir / "local_pids.json").read_text())["controller"], signal.SIGKILL)
    poll(lambda: not living_pids(pids["ranks"]), 30, "the rank killed with its parents")
    assert living_pids([stray]) == [stray]
    row = status_row(orch_env, job_id)
    assert not row["terminal"], row
    res = run_cli(["resume", job_id], orch_env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"pid {stray}" in res.stderr and "train a second job" in res.stderr, res.stderr
    res = run_cli(["cancel", job_id], orch_env)  # not "already ended": it signals the stray
    assert res.returncode == 0, res.stdout + res.stderr
    kill_tree(stray)
    row = poll(
        lambda: (r := status_row(orch_env, job_id))["terminal"] and r, 30, "ended once the stray is gone"
    )
    res = run_cli(["resume", job_id], orch_env)
    assert "still runs" not in res.stderr, res.stderr


def test_an_ended_job_stays_ended_when_its_run_directory_goes(
    orch_env: dict[str, str], started: list[int]
) -> None:
    """Before: a COMPLETED or FAILED job whose run directory was moved read PENDING ("local launcher
    has not started"), recorded COMPLETED -> PENDING, and ``wait`` never returned."""
    job_id, run_dir = _submit(orch_env, nodes=1)
    pids = poll(lambda: _training(run_dir, 1), 120, "training")
    assert run_cli(["cancel", job_id], orch_env).returncode == 0
    _ends_only_when_ranks_are_gone(orch_env, job_id, pids["ranks"])
    moved = run_dir.with_name(run_dir.name + ".moved")
    shutil.move(run_dir, moved)
    row = status_row(orch_env, job_id)
    assert row["state"] == "CANCELLED" and row["terminal"], row
    assert row["stale"], row  # the registry's record, not a look at the run directory
    res = run_cli(["status", job_id], orch_env, timeout=60)
    assert f"run directory {run_dir} is missing" in res.stdout + res.stderr, res.stdout + res.stderr
    res = run_cli(["wait", job_id], orch_env, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    res = run_cli(["status", job_id, "--watch"], orch_env, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    from orchestrator.registry.store import Registry

    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as registry:
        history = [str(change.state) for change in registry.history(job_id)]
    assert history[-1] == "CANCELLED" and "PENDING" not in history[history.index("CANCELLED") :], history
