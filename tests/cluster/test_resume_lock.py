"""Two `resume` of one job started together on the real cluster submit exactly once: the run lock holds
across the check and the submission; the other exits 2 naming the job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from orchestrator.contract.run_dir import RUN_LOCK_FILE
from orchestrator.registry.store import Registry
from tests.helpers.cli import REPO, job_and_run_dir, kill_tree, poll, run_cli, sacct_state
from tests.helpers.run_dirs import make_checkpoint
from tests.helpers.slurm_cluster import job_state


def family(pid: int) -> set[int]:
    """``pid`` and its descendants (the sbatch caller may be a child of the resume process)."""
    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return {pid}


def waits_for_lock(pid: int, lock_file: Path) -> bool:
    """``pid`` has the run's lock file open while some process holds a lock on it (/proc/locks):
    it is in the run lock's wait."""
    inode = lock_file.stat().st_ino if lock_file.exists() else None
    if inode is None:
        return False
    try:
        opened = any(os.readlink(fd) == str(lock_file) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    held = [line for line in Path("/proc/locks").read_text().splitlines() if f":{inode} " in line]
    return opened and any(str(pid) not in line.split()[4:5] for line in held)


FAIL_THEN_WAIT = """\
import os, sys, time
from pathlib import Path
# Fails while the test's switch file is absent (the job to resume); afterwards (the resumed job)
# stays up until cancelled, so the second resume finds a live job in the run.
if not Path(sys.argv[1]).exists():
    sys.exit(1)
time.sleep(600)
"""


@pytest.mark.slow
def test_two_resumes_started_together_submit_once(
    slurm_cluster: dict, orch_env: dict, tmp_path: Path
) -> None:
    script = tmp_path / "fail_then_wait.py"
    script.write_text(FAIL_THEN_WAIT)
    switch = tmp_path / "switch"
    res = run_cli(
        [
            "submit",
            "--profile",
            "slurm_test",
            "--nodes",
            "1",
            "--wait",
            "--poll",
            "0.5",
            "--",
            str(script),
            str(switch),
        ],
        orch_env,
        timeout=240,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    assert sacct_state(job_id) == "FAILED"
    make_checkpoint(run_dir, 5, {"model.safetensors": 16})
    switch.write_text("")
    # The overlap is made certain, not left to timing: the first resume to reach sbatch waits there
    # (an sbatch in front of the real one, holding on an event) until the other resume is either
    # waiting for the run lock (it has the lock file open while a lock is held on it) or has
    # reached sbatch too (no lock kept it out).
    real_sbatch = shutil.which("sbatch")
    assert real_sbatch is not None
    bin_dir, calls, release = tmp_path / "bin", tmp_path / "sbatch_calls", tmp_path / "release"
    bin_dir.mkdir()
    shim = bin_dir / "sbatch"
    shim.write_text(
        "#!/bin/bash\n"
        f"echo $PPID >> {calls}\n"
        f"for _ in $(seq 1200); do [ -e {release} ] && break; sleep 0.1; done\n"
        f'exec {real_sbatch} "$@"\n'
    )
    shim.chmod(0o755)
    env = dict(orch_env, PATH=f"{bin_dir}{os.pathsep}{orch_env['PATH']}")
    lock_file = run_dir / RUN_LOCK_FILE
    new_ids: list[str] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "resume", job_id],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
            for _ in range(2)
        ]

        def overlapped() -> str:
            callers = calls.read_text().split() if calls.exists() else []
            if len(callers) >= 2:
                return "both resumes reached sbatch"
            if len(callers) == 1:
                other = [p for p in procs if int(callers[0]) not in family(p.pid)]
                if len(other) == 1 and waits_for_lock(other[0].pid, lock_file):
                    return "the other resume waits for the run lock"
            return ""

        how = poll(overlapped, 150, "both resumes inside the run change at once")
        release.write_text(how)
        assert how == "the other resume waits for the run lock", how
        results = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=180)
            finally:
                kill_tree(p.pid)
            results.append((p.returncode, out, err))
        for _, out, _ in results:
            new_ids += [line.split()[-1] for line in out.splitlines() if line.startswith("submitted job ")]
        assert sorted(rc for rc, _, _ in results) == [0, 2], results
        assert len(new_ids) == 1, results
        (refused,) = [err for rc, _, err in results if rc == 2]
        assert new_ids[0] in refused and "Traceback" not in refused, refused
        with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
            assert reg.run_of(job_id).job_ids == (job_id, new_ids[0])
        assert sorted(p.name for p in (run_dir).glob("job.attempt_*.json")) == [
            "job.attempt_0.json",
            "job.attempt_1.json",
        ]
        # status rolls the run up with the live job.
        st = run_cli(["status", "--json", job_id], orch_env)
        row = json.loads(st.stdout)["jobs"][0]
        assert row.get("continued_as") == new_ids[0], row
        poll(
            lambda: job_state(new_ids[0]) in ("PENDING", "RUNNING"),
            60,
            "the resumed job to be live",
        )
    finally:
        release.write_text("")
        for p in procs:
            kill_tree(p.pid)
        for j in new_ids:
            subprocess.run(["scancel", j], capture_output=True, timeout=30, check=False)
