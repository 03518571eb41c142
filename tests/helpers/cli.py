"""Running the CLI and waiting for things, with bounded timeouts everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run_cli(
    args: list[str], env: dict[str, str], timeout: float = 120, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run `python -m orchestrator ARGS` with a hard timeout; the whole process group dies on timeout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"orchestrator {' '.join(args)} did not finish in {timeout} s\n{out}\n{err}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True) + [parent]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def sacct_state(job_id: str, timeout: float = 60.0) -> str:
    """Final job state from accounting, polled with a deadline (slurmdbd records asynchronously)."""
    import time

    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sacct", "-nXP", "-j", job_id, "-o", "State"], capture_output=True, text=True, timeout=15
        ).stdout.strip()
        state = out.splitlines()[-1].split()[0] if out else ""
        if state and state not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"):
            return state
        time.sleep(0.5)
    return state


def job_and_run_dir(submit_stdout: str) -> tuple[str, Path]:
    """Job id and run directory from what `orchestrator submit` prints."""
    job_id = submit_stdout.split("submitted job ")[1].split()[0]
    return job_id, Path(submit_stdout.split("run directory ")[1].split()[0])


def submit_local(env: dict[str, str], script: str, *script_args: str, nodes: int = 1) -> tuple[str, Path]:
    """``submit --profile local --nodes N --procs-per-node 1 -- SCRIPT ARGS`` (no wait): job id and run dir."""
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", str(nodes), "--procs-per-node", "1", "--", script,
         *script_args],
        env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return job_and_run_dir(res.stdout)


def user_profile_dir(tmp_path: Path, profile: str = "slurm_test", **overrides: object) -> Path:
    """A user profile folder whose ``profile`` overrides the built-in one by name (more than one
    profile per test: one folder)."""
    import yaml

    data = yaml.safe_load((REPO / "cluster_profiles" / f"{profile}.yaml").read_text())
    data.update(overrides)
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    (folder / f"{profile}.yaml").write_text(yaml.safe_dump(data))
    return folder


def living_pids(pids: list[int]) -> list[int]:
    """Those of ``pids`` still alive (a zombie has ended: only its exit status is left)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def train_losses(run_dir: Path) -> list[float]:
    """Losses of the train events rank 0 wrote into metrics.jsonl, in order."""
    import json

    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [e["loss"] for e in events if e.get("event") == "train"]


def first_train_event(run_dir: Path) -> dict:
    """The first train event of metrics.jsonl (a ``startup`` event of train/ comes before it)."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return next(e for e in map(json.loads, filter(str.strip, lines)) if e.get("event") == "train")


def poll(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.3,
    diagnostics: Callable[[], str] | None = None,
) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = diagnostics() if diagnostics else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{extra}")
        time.sleep(interval)


def job_ended(env: dict[str, str], job_id: str) -> bool:
    """Whether ``orchestrator status`` says the job is over (squeue shows COMPLETING for a while after
    sacct records CANCELLED; a resume meanwhile is rightly refused)."""
    import json

    res = run_cli(["status", job_id, "--json"], env, timeout=60)
    return res.returncode == 0 and bool(json.loads(res.stdout)["jobs"][0]["terminal"])


def status_row(env: dict[str, str], job_id: str) -> dict[str, Any]:
    """``status JOB --json``'s row of the job (the command must succeed)."""
    res = run_cli(["status", job_id, "--json"], env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)["jobs"][0]


#: The probe: an unchanged Accelerate script that checks the world size it gets and writes what
#: each rank saw into its ``--out`` folder (tests/scripts/plain_accelerate.py).
PLAIN_ACCELERATE = str(REPO / "tests" / "scripts" / "plain_accelerate.py")


def probe_args(world_size: int, out: Path | str, script: str = PLAIN_ACCELERATE) -> list[str]:
    """What follows ``submit``'s options to run the probe: ``-- SCRIPT --expect-world-size N --out OUT``."""
    return ["--", script, "--expect-world-size", str(world_size), "--out", str(out)]
