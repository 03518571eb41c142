"""What a submission left behind, and how a refusal reads: shared by the submission tests with and
without the cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

from orchestrator.registry.store import Registry


def run_dirs(env: dict[str, str]) -> list[Path]:
    root = Path(env["ORCHESTRATOR_RUNS"])
    return sorted(root.iterdir()) if root.is_dir() else []


def registry_jobs(env: dict[str, str]) -> list[str]:
    with Registry.open(Path(env["ORCHESTRATOR_HOME"])) as reg:
        return [j.job_id for j in reg.list_jobs()]


def assert_refused(res: subprocess.CompletedProcess[str], *words: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for word in words:
        assert word in lines[0], lines[0]
