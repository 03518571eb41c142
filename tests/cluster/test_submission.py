"""Submission on the real cluster: refusals before anything is submitted (exit 2, one line, no run
directory, no Slurm job), and a submit killed around sbatch leaves no job unknown to the registry
(adopted) and no half-made run directory (removed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.schedulers.base import submission_token
from tests.helpers.cli import REPO, kill_tree, poll, run_cli
from tests.helpers.slurm_cluster import controller_job_ids, scancel_quietly
from tests.helpers.submission import assert_refused, registry_jobs, run_dirs

TRAIN = str(REPO / "train" / "train.py")


# ---------------------------------------------------------------------------- on the real cluster
def _sacct_column(field: str) -> set[str]:
    """One column of every job accounting knows from the last hour."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-a", "-S", "now-1hours", "-o", field],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return {line.strip() for line in out.splitlines() if line.strip()}


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
    assert_refused(res, *words)
    assert run_dirs(orch_env) == [] and registry_jobs(orch_env) == []
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
    # submit asks `sbatch --test-only` for a start estimate first: that call is not the submission.
    passthrough = f'case " $* " in *" --test-only "*) exec "{real}" "$@";; esac\n'
    shim.write_text("#!/bin/bash\n# test shim: the real sbatch, made slow\n" + passthrough + body)
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


def test_submit_killed_while_sbatch_runs_is_adopted(
    slurm_cluster: dict, orch_env: dict[str, str], tmp_path: Path
) -> None:
    said = _killed_submit(orch_env, tmp_path, after=True)
    job_id = said.split()[-1]
    assert job_id.isdigit(), said
    try:
        assert registry_jobs(orch_env) == [], "the kill came before the job was recorded"
        res = run_cli(["list", "--json"], orch_env)
        assert res.returncode == 0, res.stderr
        assert f"adopted job {job_id}" in res.stderr
        assert [j["job_id"] for j in json.loads(res.stdout)] == [job_id]
        (run_dir,) = run_dirs(orch_env)
        assert (run_dir / "submitit" / f"{job_id}_submitted.pkl").is_file(), "the job can run"
        assert (run_dir / "job_id").read_text() == job_id and (run_dir / "job.json").is_file()
        # No job carrying one of our tokens is unknown to the registry.
        queued = subprocess.run(
            ["squeue", "-h", "--me", "-o", "%i|%k"], capture_output=True, text=True, timeout=30
        )
        ours = {line.split("|")[0] for line in queued.stdout.splitlines() if "|orchestrator-" in line}
        assert ours <= set(registry_jobs(orch_env)), (ours, queued.stdout)
        # And it really runs: training starts (it would fail waiting for its task file otherwise).
        poll(
            lambda: (run_dir / "metrics.jsonl").exists(),
            120,
            "the adopted job to train",
            diagnostics=lambda: run_cli(["logs", job_id], orch_env).stdout,
        )
        st = run_cli(["status", "--json", job_id], orch_env)
        assert json.loads(st.stdout)["jobs"][0]["state"] in ("RUNNING", "COMPLETING", "COMPLETED"), st.stdout
        # Accounting shows the job's token (what the next test looks for, and must not find). slurmdbd
        # records a job's start late when the cores are busy: over 60 s once in a loaded CI-like run.
        poll(lambda: submission_token(run_dir, 0) in _sacct_column("Comment"), 180, "the token in sacct")
    finally:
        scancel_quietly(job_id)


def test_submit_killed_before_sbatch_leaves_nothing(
    slurm_cluster: dict, orch_env: dict[str, str], tmp_path: Path
) -> None:
    _killed_submit(orch_env, tmp_path, after=False)
    assert len(run_dirs(orch_env)) == 1, "the killed submit had made its run directory"
    token = submission_token(run_dirs(orch_env)[0], 0)
    res = run_cli(["list"], orch_env)
    assert res.returncode == 0 and "interrupted before the scheduler took it" in res.stderr, res.stderr
    assert run_dirs(orch_env) == [] and registry_jobs(orch_env) == []
    # No job carries this submission's token (sbatch --comment). Not "no new job id in sacct":
    # slurmdbd records the previous test's job a few seconds late, and it showed up as new.
    assert token not in _sacct_column("Comment")
