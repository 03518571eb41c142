"""Submission is crash-safe and validates first: owner-only run directories, refusals before anything
is made (exit 2, one line, no run directory, no Slurm job), and a submit killed around sbatch leaves
no job unknown to the registry (adopted) and no half-made run directory (removed)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.run_dir import plan_file, reserve_attempt
from orchestrator.registry.store import Registry
from tests.helpers.cli import REPO, run_cli
from tests.helpers.submission import assert_refused, registry_jobs, run_dirs

TRAIN = str(REPO / "train" / "train.py")


# ---------------------------------------------------------------------------- no cluster needed
def test_run_directory_is_owner_only(orch_env: dict[str, str], reap_local_jobs: None) -> None:
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--wait", "--poll", "0.5", "--",
         TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "3", "--ckpt-every", "3"],
        orch_env,
        timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (run_dir,) = run_dirs(orch_env)
    modes: dict[str, set[str]] = {"dir": set(), "file": set()}
    for path in [run_dir, *run_dir.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        modes[kind].add(oct(st.st_mode & 0o777))
    assert modes == {"dir": {"0o700"}, "file": {"0o600"}}, modes
    assert any(run_dir.glob("checkpoints/step_*/COMPLETE.json")), "the checkpoint is covered too"


def test_unwritable_run_root_is_refused_before_anything(orch_env: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**orch_env, "ORCHESTRATOR_RUNS": str(blocker / "runs")}
    res = run_cli(["submit", "--profile", "local", "--", TRAIN], env)
    assert_refused(res, "ORCHESTRATOR_RUNS", "not a directory")
    assert registry_jobs(env) == [] and blocker.read_text() == ""


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--wait", "--poll", "-1"], ["--poll", "-1"]),
        (["--wait", "--poll", "nan"], ["--poll"]),
        (["--procs-per-node", "100000"], ["--procs-per-node", "100000"]),
    ],
    ids=["poll-negative", "poll-nan", "procs-per-node"],
)
def test_local_refusals_leave_nothing(orch_env: dict[str, str], extra: list[str], words: list[str]) -> None:
    res = run_cli(["submit", "--profile", "local", *extra, "--", TRAIN, "--max-steps", "1"], orch_env)
    assert_refused(res, *words)
    assert run_dirs(orch_env) == [] and registry_jobs(orch_env) == []


def test_duplicate_profile_key_names_key_and_both_lines(orch_env: dict[str, str], tmp_path: Path) -> None:
    profile = tmp_path / "dup.yaml"
    profile.write_text(
        "scheduler: local\nprocs_per_node: 1\nnodes: {default: 1, max: 2}\nprocs_per_node: 2\n"
    )
    res = run_cli(["render", "--profile", str(profile)], orch_env)
    assert_refused(res, "dup.yaml", "'procs_per_node'", "line 4", "line 2")


def test_plot_never_creates_folders(orch_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(job_id="local-1", name="n", profile="local", scheduler="local", strategy="ddp", nodes=1,
                    procs_per_node=1, command=["t.py"], run_dir=run_dir)  # fmt: skip
    target = tmp_path / "nonexistent" / "dir" / "x.png"
    res = run_cli(["plot", "local-1", "-o", str(target)], orch_env)
    assert_refused(res, "does not exist")
    assert not (tmp_path / "nonexistent").exists()


def test_attempt_numbers_are_reserved_exclusively(tmp_path: Path) -> None:
    first = reserve_attempt(tmp_path, {"who": "first"})
    # A second submission that computed the same number (a race) gets the next one; nothing is overwritten.
    second = reserve_attempt(tmp_path, {"who": "second"}, first=first)
    assert (first, second) == (0, 1)
    assert json.loads(plan_file(tmp_path, 0).read_text())["who"] == "first"
    assert json.loads(plan_file(tmp_path, 1).read_text())["attempt_base"] == 1


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_interrupted_submission_is_cleaned_up_by_the_next_list(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    """A submit killed after it made its run directory and recorded its intent, before the scheduler
    took it: the next `list` removes the half-made directory and says so."""
    half_made = Path(orch_env["ORCHESTRATOR_RUNS"]) / "20260101-000000-x-abcdef"
    half_made.mkdir(parents=True)
    reserve_attempt(half_made, {"nodes": 1})
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.begin_submission("tok-1", half_made, 0, True, "local", {"name": "x"})
        # what a killed command leaves: its pid is gone
        reg._conn.execute("UPDATE submissions SET pid = ? WHERE token = 'tok-1'", (_dead_pid(),))
    res = run_cli(["list"], orch_env)
    assert res.returncode == 0, res.stderr
    assert "interrupted before the scheduler took it" in res.stderr and str(half_made) in res.stderr
    assert not half_made.exists()
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        assert [i.state for i in reg.submissions()] == ["abandoned"]
        assert not reg.has_pending_submissions()
