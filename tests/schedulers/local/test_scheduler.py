"""`orchestrator submit --profile local`: the real entry point, submitit's LocalExecutor, accelerate launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import api
from orchestrator.contract.errors import UserError
from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from tests.helpers.cli import PLAIN_ACCELERATE, REPO, poll, probe_args, run_cli

SCRIPT = PLAIN_ACCELERATE


def _records(prefix: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}").read_text()) for r in range(world)]


@pytest.mark.usefixtures("reap_local_jobs")
def test_unmodified_script_gets_requested_world_size(orch_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = run_cli(
        [
            "submit",
            "--profile",
            "local",
            "--nodes",
            "2",
            "--strategy",
            "ddp",
            "--wait",
            "--poll",
            "0.5",
            *probe_args(4, out),
        ],
        orch_env,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted job local-" in res.stdout and "COMPLETED" in res.stdout
    records = _records(out, 4)
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 for r in records)
    assert all(r["rank_sum"] == 6.0 for r in records)  # the all-reduce crossed every rank
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    configs = sorted((run_dir / "logs" / "attempt_0").glob("accelerate_config.node*.yaml"))
    assert [c.name for c in configs] == ["accelerate_config.node0.yaml", "accelerate_config.node1.yaml"]
    assert "machine_rank: 1" in configs[1].read_text()  # rendered on the node, not on the submitter
    assert json.loads((run_dir / "job.json").read_text())["world_size"] == 4
    # state and registry agree
    st = run_cli(
        ["status", "--json", run_dir.name and res.stdout.split("submitted job ")[1].split()[0]], orch_env
    )
    assert st.returncode == 0 and "COMPLETED" in st.stdout


@pytest.mark.usefixtures("reap_local_jobs")
def test_two_jobs_at_once_do_not_clash(orch_env: dict[str, str], tmp_path: Path) -> None:
    import subprocess
    import sys

    procs = []
    for i in range(2):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "orchestrator",
                    "submit",
                    "--profile",
                    "local",
                    "--nodes",
                    "2",
                    "--wait",
                    "--poll",
                    "0.5",
                    *probe_args(4, tmp_path / f"o{i}"),
                ],
                cwd=REPO,
                env=orch_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    ports = set()
    for text in outputs:
        run_dir = Path(text.split("run directory ")[1].split()[0])
        cfg = (run_dir / "logs" / "attempt_0" / "accelerate_config.node0.yaml").read_text()
        ports.add(next(line for line in cfg.splitlines() if line.startswith("main_process_port")))
    assert len(ports) == 2


def test_dry_run_submits_nothing(orch_env: dict[str, str], tmp_path: Path) -> None:
    res = run_cli(["submit", "--profile", "local", "--nodes", "2", "--dry-run", "--", SCRIPT], orch_env)
    assert res.returncode == 0, res.stderr
    assert "accelerate_config.node1.yaml" in res.stdout and "nothing submitted" in res.stdout
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "home" / "registry.db").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--strategy", "hybrid_shard", "--nodes", "1", "--", SCRIPT], "needs >= 2 nodes"),
        (["--nodes", "9", "--", SCRIPT], "allows at most 4"),
        (["--", "no/such/script.py"], "training script not found"),
        ([], "no training script"),
    ],
)
def test_bad_requests_exit_2_and_leave_nothing(
    orch_env: dict[str, str], tmp_path: Path, args: list[str], needle: str
) -> None:
    res = run_cli(["submit", "--profile", "local", *args], orch_env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------
# The prewarmed launcher (node_entry.PrewarmedLauncher): started before the node's command is known.


def test_prewarmed_launcher_runs_the_command_with_the_env_and_log_handed_over(tmp_path: Path) -> None:
    """The interpreter started early must end up running exactly the launch it is handed: that argv,
    that environment (not the one it was started with), output appended to the node log."""
    import os

    from orchestrator.node.entry import PrewarmedLauncher

    script = tmp_path / "show_env.py"
    script.write_text("import os\nprint('MARK=' + os.environ.get('ORCH_TEST_MARK', 'missing'), flush=True)\n")
    log_path = tmp_path / "node_0.log"
    log_path.write_bytes(b"before\n")
    env = {**os.environ, "ORCH_TEST_MARK": "handed-over", "ACCELERATE_USE_CPU": "1"}
    prewarmed = PrewarmedLauncher()
    assert prewarmed.proc is not None  # accelerate is installed in the test environment
    with open(log_path, "ab", buffering=0) as log_bin:
        proc = prewarmed.hand_off(
            [
                "accelerate",
                "launch",
                "--cpu",
                "--num_processes",
                "1",
                "--num_machines",
                "1",
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                str(script),
            ],
            env,
            log_path,
            log_bin,
        )
        assert proc.wait(timeout=120) == 0, log_path.read_text()
    text = log_path.read_text()
    assert text.startswith("before\n") and "MARK=handed-over" in text, text


def test_prewarmed_launcher_discarded_before_hand_off_leaves_nothing_running() -> None:
    from orchestrator.node.entry import PrewarmedLauncher

    prewarmed = PrewarmedLauncher()
    proc = prewarmed.proc
    assert proc is not None
    prewarmed.discard()
    assert proc.poll() is not None and prewarmed.proc is None
    prewarmed.discard()  # idempotent


def _status_row(job: str, env: dict[str, str]) -> dict:
    res = run_cli(["status", job, "--json"], env)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)["jobs"][0]


@pytest.mark.usefixtures("reap_local_jobs")
def test_resumed_local_job_keeps_each_jobs_own_state(orch_env: dict[str, str]) -> None:
    """A cancelled local job resumed into its run directory: that directory's files now describe the new
    job, yet the old one stays CANCELLED, and `status` rolls the run up to the new job's outcome."""
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--strategy", "ddp", "--",
         "train/train.py", "--preset", "tiny", "--data", "synthetic", "--max-steps", "150", "--ckpt-every", "2",
         "--log-every", "1", "--eval-every", "0"],
        orch_env,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    old = res.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(res.stdout.split("run directory ")[1].split()[0])
    poll(lambda: list((run_dir / "checkpoints").glob("step_*/COMPLETE.json")), 120, "a complete checkpoint")
    early = run_cli(["resume", old], orch_env)  # while it trains: a second job in the same run dir, refused
    assert early.returncode == 2 and "is RUNNING" in early.stderr, early.stdout + early.stderr
    assert (run_dir / "job_id").read_text() == old
    assert run_cli(["cancel", old], orch_env).returncode == 0
    poll(lambda: _status_row(old, orch_env)["state"] == "CANCELLED", 60, f"{old} CANCELLED")

    res = run_cli(["resume", old, "--wait", "--poll", "0.5"], orch_env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    new = res.stdout.split("submitted job ")[1].split()[0]
    assert new != old and (run_dir / "job_id").read_text() == new
    row = _status_row(old, orch_env)
    assert (row["state"], row["continued_as"], row["run_state"]) == ("CANCELLED", new, "COMPLETED"), row
    assert _status_row(new, orch_env)["state"] == "COMPLETED"
    table = run_cli(["status", old], orch_env).stdout
    assert f"CANCELLED -> {new} COMPLETED" in table, table
    # the old id names the run, whose newest job has ended: nothing to cancel, no marker left behind
    refused = run_cli(["cancel", old], orch_env)
    assert refused.returncode == 2 and f"job {new} already ended (COMPLETED)" in refused.stderr, (
        refused.stderr
    )
    assert not (run_dir / "cancel_requested.json").exists()

    # A resume of a COMPLETED run exits 2 with the reason and submits nothing (docs/resume-and-faults.md,
    # "How resume works"): by the new id, by the old one, and through the API's Job.status and Job.resume.
    attempts = sorted(p.name for p in run_dir.glob("job.attempt_*.json"))
    for job in (new, old):
        done = run_cli(["resume", job], orch_env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "COMPLETED: its training finished, there is nothing to resume" in done.stderr, done.stderr
        assert "submitted job" not in done.stdout and "Traceback" not in done.stderr
    handle = api.get_job(new, Path(orch_env["ORCHESTRATOR_HOME"]))
    assert handle.status().state is JobState.COMPLETED
    with pytest.raises(UserError, match="COMPLETED: its training finished"):
        handle.resume()
    assert (run_dir / "job_id").read_text() == new
    assert sorted(p.name for p in run_dir.glob("job.attempt_*.json")) == attempts
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        assert reg.run_of(old).job_ids == (old, new)
