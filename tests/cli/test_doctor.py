"""``orchestrator doctor`` through the real CLI, without a cluster: bad input is one line and exit 2,
nothing started, and the command imports neither torch nor accelerate on the submitting side. What
it finds on real nodes: ``tests/cluster/test_doctor.py``; its decision: ``tests/supervise/test_doctor.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.runner.doctor import DOCTOR_FOLDER
from tests.helpers.cli import REPO, run_cli, user_profile_dir


def env_for(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
        "ORCHESTRATOR_RUNS": str(tmp_path / "runs"),
    }


@pytest.mark.parametrize(
    "args, words",
    [
        (["doctor", "local"], "a local profile's nodes are processes of this machine"),
        (["doctor", "no_such_profile"], "no_such_profile"),
        (["doctor", "slurm_test", "--nodes", "9"], "--nodes 9: profile slurm_test allows 1 to 4 nodes"),
        (["doctor", "slurm_test", "--nodes", "0"], "nodes: expected an integer >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_started(
    args: list[str], words: str, tmp_path: Path
) -> None:
    proc = run_cli(args, env_for(tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not (tmp_path / "runs" / DOCTOR_FOLDER).exists()


def test_profiles_dir_is_respected(tmp_path: Path) -> None:
    folder = user_profile_dir(tmp_path, "slurm_test", nodes={"default": 1, "max": 1})
    proc = run_cli(["doctor", "slurm_test", "--nodes", "2", "--profiles-dir", str(folder)], env_for(tmp_path))
    assert proc.returncode == 2 and "allows 1 to 1 nodes" in proc.stderr, proc.stderr


def test_the_submitting_side_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from orchestrator.cli.main import main\n"
        "code = main(['doctor', 'slurm_test', '--nodes', '9'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'accelerate'))\n"
        "print(json.dumps([code, heavy]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [2, []], proc.stderr


def test_the_table_folds_passing_checks_and_keeps_each_failure() -> None:
    from orchestrator.cli.doctor import table_rows
    from orchestrator.supervise.doctor import Row

    rows = [
        Row("/dev/shm", "n1", True, "8.0 GiB"),
        Row("/dev/shm", "n2", True, "8.0 GiB"),
        Row("ulimit -l", "n1", True, "8192 KiB"),
        Row("ulimit -l", "n2", False, "64 KiB < 8192 KiB", "fix"),
        Row("all-reduce", "all", True, "2000 Mbit/s"),
    ]
    assert table_rows(rows) == [
        {"check": "/dev/shm", "node": "all 2", "result": "ok", "value": "8.0 GiB"},
        {"check": "ulimit -l", "node": "n1", "result": "ok", "value": "8192 KiB"},
        {"check": "ulimit -l", "node": "n2", "result": "FAIL", "value": "64 KiB < 8192 KiB"},
        {"check": "all-reduce", "node": "all", "result": "ok", "value": "2000 Mbit/s"},
    ]
