"""The state of a ``local`` job, read from its run directory (there is no scheduler to ask)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract import run_alive
from orchestrator.contract.job_states import JobState
from orchestrator.contract.run_dir import (
    CANCEL_MARKER,
    LOCAL_PIDS_FILE,
    LOCAL_STATE_FILE,
    NODE_EXIT_RE,
    attempt_dirs,
    read_current_plan_json,
    read_json,
)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class LocalState:
    """State of a ``local`` job as read from its run directory."""

    state: JobState
    exit_code: int | None = None
    reason: str | None = None
    alive_pids: tuple[int, ...] = ()
    holders: tuple[int, ...] = ()
    """The pids on this host that hold the run's lock (orchestrator.contract.run_alive)."""


def read_local_pids(run_dir: Path) -> dict[str, int]:
    """``local_pids.json`` as ``{node: pid}`` (empty if the launcher has not written it yet)."""
    data = read_json(Path(run_dir) / LOCAL_PIDS_FILE) or {}
    return {str(k): v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _pid_alive(pid: int, not_after: float | None) -> bool:
    """True if ``pid`` runs and is not a zombie, and (when known) started before the pid file was
    written -- a recycled pid belonging to some later process must not make a dead job look alive."""
    import psutil  # local import: only local jobs pay for it

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not (not_after is not None and proc.create_time() > not_after + 2.0)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def node_exit_codes(attempt_dir: Path) -> dict[int, int]:
    """``{node: exit code}`` from the ``node_<N>.exit`` files the node entry point writes last."""
    codes: dict[int, int] = {}
    try:
        entries = list(os.scandir(attempt_dir))
    except OSError:
        return codes
    for entry in entries:
        m = NODE_EXIT_RE.match(entry.name)
        if not m:
            continue
        try:
            codes[int(m.group(1))] = int(Path(entry.path).read_text().strip())
        except (OSError, ValueError):
            continue
    return codes


def local_state(run_dir: Path | str) -> LocalState:
    """Derive a local job's state from its run directory.

    Order of evidence: the launcher's final ``local_state.json``; live processes from
    ``local_pids.json`` (RUNNING); every node of the latest attempt having written its
    ``node_<N>.exit`` (COMPLETED if all are 0); a cancel marker (CANCELLED); processes gone with no
    final record (FAILED). No pid file yet means the launcher has not started (PENDING).
    """
    run_dir = Path(run_dir)
    living = run_alive.holders(run_dir)
    if living is not None:
        # A job has ended only when its processes are gone (orchestrator.contract.run_alive), whatever
        # its controller or its final record say: a rank orphaned by a killed controller trains on.
        recorded = read_local_pids(run_dir)
        try:
            started: float | None = (run_dir / LOCAL_PIDS_FILE).stat().st_mtime
        except OSError:
            started = None
        recorded_alive = [p for p in recorded.values() if _pid_alive(p, started)]
        # Signals go to the recorded controller while it lives (it reaches every node); to the
        # processes holding the run's lock once it is gone.
        return LocalState(JobState.RUNNING, alive_pids=tuple(recorded_alive or living), holders=tuple(living))
    final = read_json(run_dir / LOCAL_STATE_FILE)
    if final is not None:
        raw = str(final.get("state", "UNKNOWN")).upper()
        state = JobState(raw) if raw in JobState.__members__ else JobState.UNKNOWN
        code = final.get("exit_code")
        reason = final.get("reason")
        return LocalState(
            state,
            code if isinstance(code, int) and not isinstance(code, bool) else None,
            reason if isinstance(reason, str) else None,
        )
    pids_path = run_dir / LOCAL_PIDS_FILE
    pids = read_local_pids(run_dir)
    if not pids:
        return LocalState(JobState.PENDING, reason="local launcher has not started")
    try:
        written = pids_path.stat().st_mtime
    except OSError:
        written = None
    alive = tuple(p for p in pids.values() if _pid_alive(p, written))
    if alive:
        return LocalState(JobState.RUNNING, alive_pids=alive)
    cancelled = (run_dir / CANCEL_MARKER).exists()
    attempts = attempt_dirs(run_dir)
    if attempts:
        codes = node_exit_codes(attempts[-1][1])
        expected = _int(read_current_plan_json(run_dir).get("nodes")) or len(pids)
        if codes and len(codes) >= expected:
            bad = {n: c for n, c in sorted(codes.items()) if c != 0}
            if not bad:
                return LocalState(JobState.COMPLETED, exit_code=0)
            node, code = next(iter(bad.items()))
            if cancelled:
                return LocalState(JobState.CANCELLED, exit_code=code, reason="cancelled by user")
            return LocalState(JobState.FAILED, exit_code=code, reason=f"node {node} exited {code}")
    if cancelled:
        return LocalState(JobState.CANCELLED, reason="cancelled by user")
    return LocalState(JobState.FAILED, reason="local processes exited without recording an exit code")
