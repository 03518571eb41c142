"""`orchestrator submit` against the real Slurm test cluster (tests/cluster): no mock anywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import (
    PLAIN_ACCELERATE,
    REPO,
    job_and_run_dir,
    kill_tree,
    probe_args,
    run_cli,
    sacct_state,
    user_profile_dir,
)

SCRIPT = PLAIN_ACCELERATE
TRAIN = str(REPO / "train" / "train.py")


def test_unmodified_script_spans_both_nodes(slurm_cluster: dict, orch_env: dict, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--nodes",
            "2",
            "--procs-per-node",
            "2",
            "--wait",
            "--poll",
            "0.5",
            *probe_args(4, out),
        ],
        orch_env,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    records = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(4)]
    assert {r["world_size"] for r in records} == {4}
    assert {r["rank_sum"] for r in records} == {6.0}
    assert len({r["host"] for r in records}) == 2  # two real nodes (own UTS namespaces)
    assert sacct_state(job_id) == "COMPLETED"
    sbatch = (run_dir / "sbatch.sh").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --signal=USR2@30" in sbatch


def test_shell_metacharacters_in_profile_are_inert(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    canary = tmp_path / "canary"
    evil = f"$(touch {canary}1) `touch {canary}2`; touch {canary}3 'q\"\nline2"
    profiles = user_profile_dir(
        tmp_path, env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "MARKER_VALUE": evil}
    )
    out = tmp_path / "plain"
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--profiles-dir",
            str(profiles),
            "--nodes",
            "2",
            "--name",
            f"x$(touch {canary}4);`touch {canary}5`",
            "--wait",
            "--poll",
            "0.5",
            *probe_args(2, out),
        ],
        orch_env,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert not list(tmp_path.glob("canary*")), "a profile value was executed"
    assert json.loads(Path(f"{out}.rank0").read_text())["marker"] == evil  # arrived as a literal string


def test_two_jobs_on_the_same_nodes_both_complete(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    profiles = user_profile_dir(tmp_path, extra_sbatch={"nodelist": "n1,n2"})
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "submit",
                "--profile",
                "slurm_test",
                "--profiles-dir",
                str(profiles),
                "--nodes",
                "2",
                "--wait",
                "--poll",
                "0.5",
                *probe_args(2, tmp_path / f"o{i}"),
            ],
            cwd=REPO,
            env=orch_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outputs
    jobs = [job_and_run_dir(o) for o in outputs]
    ports = {
        next(
            x
            for x in (d / "logs/attempt_0/accelerate_config.node0.yaml").read_text().splitlines()
            if "port" in x
        )
        for _, d in jobs
    }
    assert len(ports) == 2
    # both really ran on n1 and n2
    for job_id, _ in jobs:
        nodes = subprocess.run(
            ["sacct", "-nXP", "-j", job_id, "-o", "NodeList"], capture_output=True, text=True
        ).stdout
        assert nodes.strip() == "n[1-2]"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nodes", "4", "--", SCRIPT], "has 3"),
        (["--", "missing_script.py"], "training script not found"),
        (["--strategy", "zero3", "--", SCRIPT], "invalid choice"),
    ],
)
def test_bad_requests_exit_2_before_submitting(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path, args: list[str], needle: str
) -> None:
    # Only this request's own jobs (by a name no other test uses): other tests' jobs come and go
    # in the same cluster meanwhile, so the whole listing is no measure.
    name = f"refused-{tmp_path.name}"
    res = run_cli(["submit", "--profile", "slurm_test", "--name", name, *args], orch_env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()
    for query in (["squeue", "-h", "-t", "all", "-n", name], ["sacct", "-nX", "--name", name]):
        listed = subprocess.run(
            [*query, "-o", "%i" if query[0] == "squeue" else "JobID"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert listed.returncode == 0 and listed.stdout.strip() == "", (query, listed.stdout, listed.stderr)


def test_unknown_partition_exits_2(slurm_cluster: dict, orch_env: dict, tmp_path: Path) -> None:
    profiles = user_profile_dir(tmp_path, partition="nosuchpart")
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--", SCRIPT], orch_env
    )
    assert res.returncode == 2 and "partition 'nosuchpart' does not exist" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


def test_exclude_keeps_the_job_off_those_nodes(slurm_cluster: dict, orch_env: dict, tmp_path: Path) -> None:
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--nodes", "2", "--exclude", "n1", "--wait", "--poll", "0.5",
         *probe_args(2, tmp_path / "plain")],
        orch_env, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    job_and_run_dir(res.stdout)
    # Where the ranks ran, from their own hostnames (each node has its own UTS namespace). Not
    # sacct's NodeList: for a job this short, slurmdbd can record it after the completing job has
    # released a node (CI saw "n2" for a job that ran on n2 and n3).
    hosts = sorted(json.loads((tmp_path / f"plain.rank{r}").read_text())["host"] for r in range(2))
    assert hosts == ["n2", "n3"]  # of n1..n3, the two that were not excluded


def test_snapshot_runs_the_script_as_it_was_at_submit(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    script = folder / "train_me.py"
    script.write_text(Path(SCRIPT).read_text())
    out = tmp_path / "plain"
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--nodes", "1", "--snapshot", *probe_args(1, out, script=str(script))],
        orch_env, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    # Edited right after submitting (the job may not even have started): the job must not see it.
    script.write_text("raise SystemExit('the edited script ran')\n")
    job_id, run_dir = job_and_run_dir(res.stdout)
    assert sacct_state(job_id, timeout=180) == "COMPLETED"
    assert json.loads(Path(f"{out}.rank0").read_text())["world_size"] == 1
    assert (run_dir / "snapshot" / "train_me.py").read_text() == Path(SCRIPT).read_text()
    assert json.loads((run_dir / "job.json").read_text())["script"] == str(
        run_dir / "snapshot" / "train_me.py"
    )
