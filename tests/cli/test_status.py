"""`orchestrator status` (orchestrator/cli/status.py): REQUEUES counts this job's requeues,
never the attempts of earlier jobs of the same run (`resume` continues the attempt numbering in
the run directory)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from tests.helpers.cli import run_cli


def _run_dir(root: Path, attempts: int, submissions: list[int]) -> Path:
    run_dir = root / "run"
    for a in range(attempts):
        (run_dir / "logs" / f"attempt_{a}").mkdir(parents=True)
    for base in submissions:
        (run_dir / f"job.attempt_{base}.json").write_text(json.dumps({"attempt_base": base}))
    (run_dir / "local_state.json").write_text(json.dumps({"state": "COMPLETED", "exit_code": 0}))
    return run_dir


def _requeues(orch_env: dict[str, str], run_dir: Path) -> int:
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(
            job_id="local-2", name="t", profile="local", scheduler="local", strategy="ddp", nodes=1,
            procs_per_node=2, command=["python"], run_dir=run_dir, state=JobState.RUNNING,
        )  # fmt: skip
    res = run_cli(["status", "--json", "local-2"], orch_env, timeout=60)
    assert res.returncode == 0, res.stderr
    return int(json.loads(res.stdout)["jobs"][0]["requeues"])


def test_a_resumed_run_is_not_counted_as_requeues(orch_env: dict[str, str], tmp_path: Path) -> None:
    # attempt 0: the first job; attempts 1 and 2: two manual resumes, each a submission of its own.
    assert _requeues(orch_env, _run_dir(tmp_path, 3, [0, 1, 2])) == 0


def test_requeues_after_the_last_submission_count(orch_env: dict[str, str], tmp_path: Path) -> None:
    # attempt 1 was submitted by `resume`; attempts 2 and 3 are its requeues (same job, no new plan).
    assert _requeues(orch_env, _run_dir(tmp_path, 4, [0, 1])) == 2
