"""The Slurm scheduler on the real test cluster: the dry run is the submitted request, a resumed run
keeps what earlier attempts learned, and the node-side interpreter is the profile's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from orchestrator.schedulers.base import submission_token
from tests.helpers.cli import (
    REPO,
    job_and_run_dir,
    job_ended,
    poll,
    probe_args,
    run_cli,
    sacct_state,
    user_profile_dir,
)

TRAIN = str(REPO / "train" / "train.py")
TINY = ["--preset", "tiny", "--data", "synthetic", "--batch-size", "4", "--seq-len", "64", "--log-every", "1"]


def sections(output: str) -> dict[str, str]:
    """``==> NAME <==`` sections of ``render``/``submit --dry-run`` output, each as a file's text."""
    parts = re.split(r"^==> (.+) <==\n", output, flags=re.M)
    return {
        name: body.split("\n# dry run:")[0].rstrip("\n") + "\n"
        for name, body in zip(parts[1::2], parts[2::2])
    }


def test_dry_run_is_byte_for_byte_the_submitted_script(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    args = [
        "--profile",
        "slurm_test",
        "--nodes",
        "2",
        "--name",
        "same",
        *probe_args(2, tmp_path / "plain"),
    ]
    dry = run_cli(["submit", "--dry-run", *args], orch_env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    planned = dry.stdout.split("run directory would be ")[1].split(")")[0]
    assert not Path(planned).exists() and not (tmp_path / "runs").exists()  # a dry run creates nothing
    shown = sections(dry.stdout)["sbatch.sh"]

    res = run_cli(["submit", "--wait", "--poll", "0.5", *args], orch_env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    submitted = (run_dir / "sbatch.sh").read_text()
    # Only the run directory differs (its name carries the submission time and a random suffix), and
    # with it the submission token derived from it.
    same = shown.replace(planned, str(run_dir)).replace(
        submission_token(planned, 0), submission_token(run_dir, 0)
    )
    assert same == submitted
    # ... and that text is what sbatch itself received (submitit keeps the file it passed to sbatch).
    assert (run_dir / "submitit" / f"{job_id}_submission.sh").read_text() == submitted
    assert sacct_state(job_id) == "COMPLETED"


def test_resume_keeps_auto_resume_and_excluded_nodes(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    first = run_cli(
        ["submit", "--profile", "slurm_test", "--nodes", "2", "--auto-resume", "--exclude", "n3", "--",
         TRAIN, *TINY, "--max-steps", "100000", "--ckpt-every", "2"],
        orch_env, timeout=60,
    )  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    job_id, run_dir = job_and_run_dir(first.stdout)
    assert "#SBATCH --exclude=n3\n" in (run_dir / "sbatch.sh").read_text()
    poll(lambda: list((run_dir / "checkpoints").glob("step_*/COMPLETE.json")), 240, "a complete checkpoint")
    assert run_cli(["cancel", job_id], orch_env, timeout=60).returncode == 0
    poll(lambda: job_ended(orch_env, job_id), 180, f"job {job_id} to end", interval=0.5)

    again = run_cli(["resume", job_id], orch_env, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    new_job = again.stdout.split("submitted job ")[1].split()[0]
    try:
        assert new_job != job_id
        current = json.loads((run_dir / "job.json").read_text())
        assert (current["auto_resume"], current["exclude_nodes"], current["attempt_base"]) == (
            True,
            ["n3"],
            1,
        )
        sbatch = (run_dir / "sbatch.sh").read_text()
        assert "#SBATCH --exclude=n3\n" in sbatch
        assert "-m orchestrator.schedulers.slurm.batch_step --attempt-base 1 --auto-resume -- srun" in sbatch
        # Each submission keeps its own plan; the first one is unchanged.
        assert json.loads((run_dir / "job.attempt_0.json").read_text())["attempt_base"] == 0
        poll(lambda: (run_dir / "logs" / "attempt_1" / "node_0.log").is_file(), 120, "the new job's node log")
        nodes = subprocess.run(
            ["sacct", "-nXP", "-j", new_job, "-o", "NodeList"], capture_output=True, text=True, timeout=30
        ).stdout
        assert "n3" not in nodes
    finally:
        run_cli(["cancel", new_job], orch_env, timeout=60)


def test_node_side_interpreter_comes_from_the_setup_lines(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    """A venv that only the nodes activate (profile setup), at a path the submitting interpreter knows
    nothing of; profile key ``python: python`` is looked up after the setup lines. The set-up lines run
    on every node, before its node entry: each node leaves its own mark and exports its own name (the
    batch host's environment alone would tell every rank "n1")."""
    venv = tmp_path / "node venv"  # a space: the path must travel as one word
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    # ``--system-site-packages`` sees the base interpreter's packages, not those of a venv the suite
    # runs in (where orchestrator and torch are installed): the node venv reads that one's too, with
    # its .pth files (an editable install is one).
    (venv_site,) = venv.glob("lib/python*/site-packages")
    outer = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (venv_site / "suite_packages.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in outer)
    )
    base = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
    marks = tmp_path / "setup marks"
    setup = [
        *base.get("setup", []),
        f"source '{venv}/bin/activate'",
        f"mkdir -p '{marks}' && hostname > '{marks}'/\"$(hostname)\"",
        'export MARKER_VALUE="set up on $(hostname)"',
    ]
    profiles = user_profile_dir(tmp_path, setup=setup, python="python")
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
            "--wait",
            "--poll",
            "0.5",
            *probe_args(2, out),
        ],
        orch_env,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    records = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    assert {r["prefix"] for r in records} == {str(venv)}, records
    assert {r["python"] for r in records} == {str(venv / "bin" / "python")}
    assert len({r["host"] for r in records}) == 2
    assert [r["marker"] for r in records] == [f"set up on {r['host']}" for r in records], records
    assert sorted(p.name for p in marks.iterdir()) == sorted(r["host"] for r in records)
    node_log = (run_dir / "logs" / "attempt_0" / "node_1.log").read_text()
    assert f"python={venv}/bin/python" in node_log


def test_missing_node_interpreter_fails_the_job_with_the_reason(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    profiles = user_profile_dir(tmp_path, python="python-that-no-node-has")
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--profiles-dir",
            str(profiles),
            "--nodes",
            "1",
            "--wait",
            "--poll",
            "0.5",
            *probe_args(1, tmp_path / "plain"),
        ],
        orch_env,
        timeout=240,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    assert sacct_state(job_id) == "FAILED"
    err = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    assert "python-that-no-node-has" in err and "not found" in err and "profile key python" in err
    # No node ever logged: `logs` shows the scheduler's own files, where the reason is.
    logs = run_cli(["logs", job_id], orch_env)
    assert logs.returncode == 0 and "no node logs" in logs.stderr
    assert "python-that-no-node-has" in logs.stdout and "profile key python" in logs.stdout


def test_a_node_environment_missing_submitit_says_so_in_status_and_wait(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    """A first-day mistake on a real cluster: the nodes' venv lacks a package. Here it has every package
    of the suite's environment but submitit (each linked in, submitit left out), so Python's ``-m``
    fails with its own one-line format (no traceback): ``python: Error while finding module
    specification for 'submitit.core._submit' (ModuleNotFoundError: No module named 'submitit')``.
    ``wait`` and ``status`` must show that line and the node, not "no error found"."""
    venv = tmp_path / "node venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (venv_site,) = venv.glob("lib/python*/site-packages")
    outer = [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    for site in outer:
        for entry in site.iterdir():
            if entry.name.lower().startswith("submitit") or (venv_site / entry.name).exists():
                continue
            (venv_site / entry.name).symlink_to(entry)
    base = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
    profiles = user_profile_dir(
        tmp_path, setup=[*base.get("setup", []), f"source '{venv}/bin/activate'"], python="python"
    )
    res = run_cli(
        ["submit", "--profile", "slurm_test", "--profiles-dir", str(profiles), "--nodes", "1", "--wait",
         "--poll", "0.5", *probe_args(1, tmp_path / "plain")],
        orch_env,
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, _ = job_and_run_dir(res.stdout)
    assert "No module named 'submitit'" in res.stdout, res.stdout
    status = json.loads(run_cli(["status", job_id, "--json"], orch_env, timeout=60).stdout)["jobs"][0]
    assert status["state"] == "FAILED", status
    assert "No module named 'submitit'" in status["reason"] and "node 0" in status["reason"], status
