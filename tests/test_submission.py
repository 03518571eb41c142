"""Submission is crash-safe and validates first: owner-only run directories, refusals before anything
is made (exit 2, one line, no run directory, no Slurm job), and a submit killed around sbatch leaves
no job unknown to the registry (adopted) and no half-made run directory (removed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.run_dir import plan_file, reserve_attempt
from orchestrator.registry.store import Registry
from orchestrator.schedulers.base import submission_token
from tests.helpers.cli import REPO, kill_tree, poll, run_cli
from tests.helpers.slurm_cluster import controller_job_ids

TRAIN = str(REPO / "train" / "train.py")


def _run_dirs(env: dict[str, str]) -> list[Path]:
    root = Path(env["ORCHESTRATOR_RUNS"])
    return sorted(root.iterdir()) if root.is_dir() else []


def _registry_jobs(env: dict[str, str]) -> list[str]:
    with Registry.open(Path(env["ORCHESTRATOR_HOME"])) as reg:
        return [j.job_id for j in reg.list_jobs()]


def _assert_refused(res: subprocess.CompletedProcess[str], *words: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for word in words:
        assert word in lines[0], lines[0]


# ---------------------------------------------------------------------------- no cluster needed
def test_run_directory_is_owner_only(orch_env: dict[str, str], reap_local_jobs: None) -> None:
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "1", "--wait", "--poll", "0.5", "--",
         TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "3", "--ckpt-every", "3"],
        orch_env,
        timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (run_dir,) = _run_dirs(orch_env)
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
    _assert_refused(res, "ORCHESTRATOR_RUNS", "not a directory")
    assert _registry_jobs(env) == [] and blocker.read_text() == ""


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
    _assert_refused(res, *words)
    assert _run_dirs(orch_env) == [] and _registry_jobs(orch_env) == []


def test_duplicate_profile_key_names_key_and_both_lines(orch_env: dict[str, str], tmp_path: Path) -> None:
    profile = tmp_path / "dup.yaml"
    profile.write_text(
        "scheduler: local\nprocs_per_node: 1\nnodes: {default: 1, max: 2}\nprocs_per_node: 2\n"
    )
    res = run_cli(["render", "--profile", str(profile)], orch_env)
    _assert_refused(res, "dup.yaml", "'procs_per_node'", "line 4", "line 2")


def test_plot_never_creates_folders(orch_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(job_id="local-1", name="n", profile="local", scheduler="local", strategy="ddp", nodes=1,
                    procs_per_node=1, command=["t.py"], run_dir=run_dir)  # fmt: skip
    target = tmp_path / "nonexistent" / "dir" / "x.png"
    res = run_cli(["plot", "local-1", "-o", str(target)], orch_env)
    _assert_refused(res, "does not exist")
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


# ---------------------------------------------------------------------------- on the real cluster
def _sacct_column(field: str) -> set[str]:
    """One column of every job accounting knows from the last hour."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-a", "-S", "now-1hours", "-o", field],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return {line.strip() for line in out.splitlines() if line.strip()}


def _cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


@pytest.mark.slurm
@pytest.mark.parametrize(
    "extra, words",
    [
        (["--exclude", "n1,n2,n3"], ["--exclude", "leaves 0"]),
        (["--exclude", "zz[1-3"], ["--exclude", "zz[1-3"]),
        (["--exclude", "n9"], ["--exclude", "n9", "not in partition"]),
        (["--procs-per-node", "100000"], ["--procs-per-node", "100000"]),
        (["--procs-per-node", "200"], ["--procs-per-node", "CPUs"]),
        (["--wait", "--poll", "-1"], ["--poll"]),
    ],
    ids=["exclude-all", "exclude-malformed", "exclude-unknown", "procs-huge", "procs-over-cpus", "poll"],
)
def test_slurm_refusals_submit_nothing(
    slurm_cluster: dict, orch_env: dict[str, str], extra: list[str], words: list[str]
) -> None:
    before = controller_job_ids()
    res = run_cli(["submit", "--profile", "slurm_test", "--nodes", "2", *extra, "--", TRAIN], orch_env)
    _assert_refused(res, *words)
    assert _run_dirs(orch_env) == [] and _registry_jobs(orch_env) == []
    assert controller_job_ids() - before == set(), "no Slurm job was submitted"


def _slow_sbatch(tmp_path: Path, after: bool) -> dict[str, str]:
    """A PATH shim that wraps the real sbatch and makes it slow: it sleeps (long; the test kills it)
    after the real sbatch answered (``after``) or before calling it, and says where it is."""
    real = shutil.which("sbatch")
    assert real, "sbatch not on PATH"
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    said = shim_dir / "said"
    body = (
        f'out=$("{real}" "$@"); rc=$?\necho "$out" >"{said}.tmp"; mv "{said}.tmp" "{said}"\nsleep 300\necho "$out"; exit $rc\n'
        if after
        else f'echo waiting >"{said}.tmp"; mv "{said}.tmp" "{said}"\nsleep 300\nexec "{real}" "$@"\n'
    )
    shim = shim_dir / "sbatch"
    shim.write_text("#!/bin/bash\n# test shim: the real sbatch, made slow\n" + body)
    shim.chmod(0o755)
    return {"said": str(said), "PATH": f"{shim_dir}{os.pathsep}{os.environ['PATH']}"}


def _killed_submit(orch_env: dict[str, str], tmp_path: Path, after: bool) -> str:
    shim = _slow_sbatch(tmp_path, after)
    env = {**orch_env, "PATH": shim["PATH"]}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", "--profile", "slurm_test", "--nodes", "1", "--",
         TRAIN, "--preset", "tiny", "--data", "synthetic", "--max-steps", "400"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        poll(lambda: Path(shim["said"]).exists(), 60, "the shim to be reached")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the submit and its sbatch, like a lost terminal
        kill_tree(proc.pid)
        proc.communicate(timeout=30)
    return Path(shim["said"]).read_text().strip()


@pytest.mark.slurm
def test_submit_killed_while_sbatch_runs_is_adopted(
    slurm_cluster: dict, orch_env: dict[str, str], tmp_path: Path
) -> None:
    said = _killed_submit(orch_env, tmp_path, after=True)
    job_id = said.split()[-1]
    assert job_id.isdigit(), said
    try:
        assert _registry_jobs(orch_env) == [], "the kill came before the job was recorded"
        res = run_cli(["list", "--json"], orch_env)
        assert res.returncode == 0, res.stderr
        assert f"adopted job {job_id}" in res.stderr
        assert [j["job_id"] for j in json.loads(res.stdout)] == [job_id]
        (run_dir,) = _run_dirs(orch_env)
        assert (run_dir / "submitit" / f"{job_id}_submitted.pkl").is_file(), "the job can run"
        assert (run_dir / "job_id").read_text() == job_id and (run_dir / "job.json").is_file()
        # No job carrying one of our tokens is unknown to the registry.
        queued = subprocess.run(
            ["squeue", "-h", "--me", "-o", "%i|%k"], capture_output=True, text=True, timeout=30
        )
        ours = {line.split("|")[0] for line in queued.stdout.splitlines() if "|orchestrator-" in line}
        assert ours <= set(_registry_jobs(orch_env)), (ours, queued.stdout)
        # And it really runs: training starts (it would fail waiting for its task file otherwise).
        poll(
            lambda: (run_dir / "metrics.jsonl").exists(),
            120,
            "the adopted job to train",
            diagnostics=lambda: run_cli(["logs", job_id], orch_env).stdout,
        )
        st = run_cli(["status", "--json", job_id], orch_env)
        assert json.loads(st.stdout)["jobs"][0]["state"] in ("RUNNING", "COMPLETING", "COMPLETED"), st.stdout
        # Accounting shows the job's token (what the next test looks for, and must not find).
        poll(lambda: submission_token(run_dir, 0) in _sacct_column("Comment"), 60, "the token in sacct")
    finally:
        _cancel(job_id)


@pytest.mark.slurm
def test_submit_killed_before_sbatch_leaves_nothing(
    slurm_cluster: dict, orch_env: dict[str, str], tmp_path: Path
) -> None:
    _killed_submit(orch_env, tmp_path, after=False)
    assert len(_run_dirs(orch_env)) == 1, "the killed submit had made its run directory"
    token = submission_token(_run_dirs(orch_env)[0], 0)
    res = run_cli(["list"], orch_env)
    assert res.returncode == 0 and "interrupted before the scheduler took it" in res.stderr, res.stderr
    assert _run_dirs(orch_env) == [] and _registry_jobs(orch_env) == []
    # No job carries this submission's token (sbatch --comment). Not "no new job id in sacct":
    # slurmdbd records the previous test's job a few seconds late, and it showed up as new.
    assert token not in _sacct_column("Comment")
