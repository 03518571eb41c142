"""What one run directory holds beyond ``status``'s row: its attempts, their nodes, the hang report.

The dashboard's job page shows these; they come from the run-directory contract's own readers
(attempt folders, node logs and exit files, ``start.json``, ``hang/attempt_<A>/``), never from a
second parser of the layout. A node's exit file or a rank's stack that is a symlink out of the run
directory is not read (the dashboard would show another file's text). Straggler ranks are the heartbeats' own verdict
(:func:`orchestrator.contract.heartbeat.stragglers`), the one the watchdog logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import (
    HANG_REPORT_FILE,
    attempt_dirs,
    hang_dir,
    node_exit_file,
    node_logs,
    read_json,
)
from orchestrator.rundir.log_follow import leaves

#: Bytes of one rank's stack file shown (py-spy dumps of deep stacks run to tens of kB).
STACK_CHARS = 20_000


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Each attempt: its number, its nodes (with their exit codes once written), what it started
    from (``start.json``: a resume at step k, or step 0), and why, when it is a restart inside the
    allocation (``restarts.jsonl``)."""
    from orchestrator.contract.attempt_start import read_attempt_start
    from orchestrator.contract.restarts import read_restarts

    causes = {r.get("attempt"): r.get("cause") for r in read_restarts(Path(run_dir))}
    out: list[dict[str, Any]] = []
    for number, folder in attempt_dirs(Path(run_dir)):
        nodes = []
        for node, _log in node_logs(folder):
            path = node_exit_file(folder, node)
            try:
                code: str | None = None if leaves(path, run_dir) else path.read_text().strip() or None
            except OSError:
                code = None
            nodes.append({"node": node, "exit_code": code})
        start = read_attempt_start(Path(run_dir), number) or {}
        out.append(
            {
                "attempt": number,
                "nodes": nodes,
                "start_step": start.get("step") if isinstance(start.get("step"), int) else None,
                "start_checkpoint": start.get("checkpoint")
                if isinstance(start.get("checkpoint"), str)
                else None,
                "restarted_after": causes.get(number) if isinstance(causes.get(number), str) else None,
            }
        )
    return out


def stragglers(run_dir: Path) -> list[int]:
    """Ranks the newest attempt's heartbeats flag as slower than the others outside collectives."""
    from orchestrator.contract.heartbeat import read_heartbeats
    from orchestrator.contract.heartbeat import stragglers as find

    found = attempt_dirs(Path(run_dir))
    if not found:
        return []
    verdict = find(read_heartbeats(found[-1][1]))
    return sorted(verdict.flagged) if verdict else []


def hang_report(run_dir: Path) -> dict[str, Any] | None:
    """The newest hang report (the watchdog's ``hang.json``) with every rank's stack text, or None."""
    for number, _folder in reversed(attempt_dirs(Path(run_dir))):
        folder = hang_dir(Path(run_dir), number)
        report = read_json(folder / HANG_REPORT_FILE)
        if not isinstance(report, dict):
            continue
        stacks: dict[str, str] = {}
        for path in sorted(folder.glob("rank_*.txt"), key=lambda p: _rank_of(p.name)):
            if leaves(path, run_dir):
                continue
            try:
                with open(path, errors="replace") as fh:
                    stacks[str(_rank_of(path.name))] = fh.read(STACK_CHARS)
            except OSError:
                continue
        return {
            "attempt": number,
            "reason": report.get("reason"),
            "culprit_rank": report.get("culprit_rank"),
            "bad_node": report.get("bad_node"),
            "stacks": stacks,
        }
    return None


def _rank_of(name: str) -> int:
    digits = name.removeprefix("rank_").removesuffix(".txt")
    return int(digits) if digits.isdigit() else -1
