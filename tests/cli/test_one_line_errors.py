"""Issue #35 items 8 and 9 (and #27's polish) that need a registry row or a run directory: each
through the real CLI, on the local profile, with no training job (rows and files are written the
way the product writes them; what is "bad" is the one value a user edited by hand)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.contract.job_states import JobState
from orchestrator.registry.schema import BUSY_TIMEOUT_MS
from orchestrator.registry.store import Registry


def _cli(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line(proc: subprocess.CompletedProcess[str], command: str) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"orchestrator {command}: error: "), lines[0]
    return lines[0]


def _job(tmp_path: Path, orch_env: dict[str, str], job_id: str, state: JobState) -> Path:
    """A registry row and a run directory with the plan ``submit`` writes (``job.json``)."""
    from orchestrator import api

    plan = api.make_plan(profile="local", script=str(tmp_path / "t.py"), nodes=1, procs_per_node=1)
    run_dir = tmp_path / "runs" / job_id
    (run_dir / "logs" / "attempt_0").mkdir(parents=True)
    (run_dir / "job.json").write_text(json.dumps(plan.to_json()))
    (run_dir / "job_id").write_text(job_id)
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(
            job_id=job_id,
            name="t",
            profile="local",
            scheduler="local",
            strategy="ddp",
            nodes=1,
            procs_per_node=1,
            command=["t.py"],
            run_dir=run_dir,
            state=state,
        )
    return run_dir


def test_resume_of_an_edited_job_json_is_one_line(tmp_path: Path, orch_env: dict[str, str]) -> None:
    run_dir = _job(tmp_path, orch_env, "local-1", JobState.FAILED)
    data = json.loads((run_dir / "job.json").read_text())
    data["nodes"] = "two"
    (run_dir / "job.json").write_text(json.dumps(data))
    line = _one_line(_cli(["resume", "local-1"], orch_env, tmp_path), "resume")
    assert "job.json: nodes: expected an integer >= 1" in line and "'two'" in line


def test_one_bad_registry_row_names_it_and_shows_the_others(tmp_path: Path, orch_env: dict[str, str]) -> None:
    _job(tmp_path, orch_env, "local-1", JobState.FAILED)
    _job(tmp_path, orch_env, "local-2", JobState.FAILED)
    db = Path(orch_env["ORCHESTRATOR_HOME"]) / "registry.db"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE jobs SET nodes = 'x' WHERE job_id = 'local-1'")
    for args in (["list"], ["status"], ["list", "--json"]):
        proc = _cli(args, orch_env, tmp_path)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert "local-2" in proc.stdout, (args, proc.stdout)
        assert "registry row 'local-1': nodes: expected an integer, got 'x'" in proc.stderr, proc.stderr
        assert str(db) in proc.stderr
    line = _one_line(_cli(["status", "local-1"], orch_env, tmp_path), "status")
    assert "registry row 'local-1'" in line


def test_a_held_registry_write_lock_is_one_line_naming_the_file(
    tmp_path: Path, orch_env: dict[str, str]
) -> None:
    (tmp_path / "t.py").write_text("print('never runs')\n")
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])):
        pass
    db = Path(orch_env["ORCHESTRATOR_HOME"]) / "registry.db"
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process's write transaction, left open
        started = time.monotonic()
        proc = _cli(
            ["submit", "--nodes", "1", "--", "t.py"], orch_env, tmp_path, timeout=BUSY_TIMEOUT_MS / 1000 + 50
        )
        waited = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    line = _one_line(proc, "submit")
    assert f"registry {db} is locked" in line, line
    assert waited < 25, f"waited {waited:.0f} s for the lock"
    assert not list((tmp_path / "runs").glob("*")), "nothing is created while the registry is locked"


def test_plot_to_an_unwritable_path_is_one_line(tmp_path: Path, orch_env: dict[str, str]) -> None:
    pytest.importorskip("matplotlib")
    run_dir = _job(tmp_path, orch_env, "local-1", JobState.COMPLETED)
    events = [{"event": "train", "step": s, "loss": 2.0 - s / 10, "time": 1000.0 + s} for s in range(1, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    line = _one_line(_cli(["plot", "local-1", "-o", "/proc/x.png"], orch_env, tmp_path), "plot")
    assert "/proc/x.png" in line


def test_stacks_json_of_an_ended_job_names_no_folder(tmp_path: Path, orch_env: dict[str, str]) -> None:
    _job(tmp_path, orch_env, "local-1", JobState.COMPLETED)
    proc = _cli(["stacks", "local-1", "--json"], orch_env, tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ranks"] == []
    assert data["folder"] is None or Path(data["folder"]).is_dir(), data


def test_a_negative_step_is_not_shown(tmp_path: Path, orch_env: dict[str, str]) -> None:
    run_dir = _job(tmp_path, orch_env, "local-1", JobState.COMPLETED)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"event": "train", "step": -7, "loss": 1.5}) + "\n")
    proc = _cli(["status", "local-1", "--json"], orch_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    assert job["step"] is None, job


def test_profiles_validate_reports_every_bad_file(tmp_path: Path, orch_env: dict[str, str]) -> None:
    (tmp_path / "a.yaml").write_text("scheduler: local\nnodes: {max: two}\n")
    (tmp_path / "b.yaml").write_text("scheduler: local\n")
    (tmp_path / "c.yaml").write_text("scheduler: pbs\n")
    proc = _cli(["profiles", "validate", "a.yaml", "b.yaml", "c.yaml"], orch_env, tmp_path)
    assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 2, proc.stderr
    assert "a.yaml: nodes.max" in errors[0] and "c.yaml: scheduler" in errors[1], errors
    assert proc.stdout.strip() == "ok  b.yaml"


def test_submit_dry_run_asks_the_cluster_nothing(tmp_path: Path, orch_env: dict[str, str]) -> None:
    """``render`` never runs sinfo; ``submit --dry-run`` ran it and exited 1 where it failed."""
    (tmp_path / "t.py").write_text("print(1)\n")
    env = {**orch_env, "PATH": os.path.dirname(sys.executable)}  # no sinfo on it
    proc = _cli(["submit", "--profile", "slurm_test", "--dry-run", "--", "t.py"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH" in proc.stdout and "dry run: nothing submitted" in proc.stdout


def test_a_new_registry_numbers_local_ids_after_the_run_directories(
    tmp_path: Path, orch_env: dict[str, str], reap_local_jobs: None
) -> None:
    """A deleted registry restarted at local-1 while run directories of that id still existed."""
    old = tmp_path / "runs" / "20250101-000000-old-abc123"
    old.mkdir(parents=True)
    (old / "job_id").write_text("local-7")
    (tmp_path / "t.py").write_text("print(1)\n")
    proc = _cli(["submit", "--nodes", "1", "--procs-per-node", "1", "--", "t.py"], orch_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "submitted job local-8" in proc.stdout, proc.stdout


def test_progress_bars_show_their_last_redraw(tmp_path: Path) -> None:
    from orchestrator.rundir.log_follow import LogFollower

    node_log = tmp_path / "logs" / "attempt_0" / "node_0.log"
    node_log.parent.mkdir(parents=True)
    bar = "".join(f"\r[rank1]: {i:3d}%|{'#' * (i // 10)}|" for i in range(101))
    node_log.write_text(f"start\n{bar}\ndone\n")
    lines = [ln.text for ln in LogFollower(tmp_path, procs_per_node=2).stream(final=True)]
    assert lines == ["start", "[rank1]: 100%|##########|", "done"], lines
    only_rank1 = [ln.text for ln in LogFollower(tmp_path, rank=1, procs_per_node=2).stream(final=True)]
    assert "[rank1]: 100%|##########|" in only_rank1


def test_sweep_summary_counts_add_up() -> None:
    from orchestrator.runner.sweep_status import SweepStatus

    status = SweepStatus("9", [], [], None, "loss", None, [], [(0, {"lr": "1"}), (1, {"lr": "2"})])  # type: ignore[arg-type]
    assert status.total == 2 and sum(status.counts().values()) == status.total
