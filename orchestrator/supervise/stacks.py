"""Every rank's Python stacks, collected on the nodes that run them (py-spy), and which rank differs.

Used by the hang watchdog (:mod:`orchestrator.supervise.watchdog`, from the batch step) and by
``orchestrator stacks JOB`` (from the login host). Both run this module once per node inside the
job's allocation (beside its step: the scheduler's
:meth:`~orchestrator.schedulers.base.Scheduler.on_every_node`): a rank's memory can only be read on its own node. The node
side finds the training processes of the run from the pids the direct launcher recorded, or (torchrun)
by their environment (``ORCHESTRATOR_RUN_DIR``, ``ORCHESTRATOR_ATTEMPT`` and torchrun's ``RANK``),
so scripts without heartbeats are covered too,
writes ``rank_<R>.txt`` and prints one JSON line per rank for the caller.

py-spy reads the process from outside, so a rank that is stopped, or stuck in C++ inside a
collective, still gives its stack; ``--nonblocking`` because suspending a stopped process through
ptrace fails (measured: "Failed to suspend process").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from orchestrator.contract.env import ATTEMPT_ENV, NODE_RANK_ENV, RUN_DIR_ENV
from orchestrator.contract.run_dir import rank_stack_file

#: A frame that means "inside a collective": torch.distributed's Python API, or autograd's engine
#: (DDP/FSDP all-reduce gradients from C++ hooks during backward).
COLLECTIVE_FRAME_RE = re.compile(r"distributed_c10d\.py|torch/distributed/|_engine_run_backward")
#: Bound on one py-spy dump.
DUMP_TIMEOUT_S = 20.0
#: Bound on the whole collection (one step across the nodes).
COLLECT_TIMEOUT_S = 60.0
#: Process states that mean the rank cannot take part in anything.
DEAD_STATES = frozenset({"stopped", "tracing-stop", "zombie", "dead", "gone"})


def py_spy() -> str | None:
    """py-spy next to this interpreter (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def rank_processes(run_dir: str, attempt: int) -> dict[int, Any]:
    """``{rank: (psutil.Process, node rank)}`` of this run's training processes on this node (same UTS namespace:
    on the test cluster the nodes share one process table)."""
    import psutil

    try:
        own_uts = os.readlink("/proc/self/ns/uts")
    except OSError:
        own_uts = ""
    found = _forked_ranks(run_dir, attempt, own_uts)
    if found:
        return found
    wanted = os.path.realpath(run_dir)
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(ATTEMPT_ENV) != str(attempt) or RUN_DIR_ENV not in env:
            continue
        if os.path.realpath(env[RUN_DIR_ENV]) != wanted:
            continue
        if "RANK" not in env or "LOCAL_RANK" not in env:
            continue  # the launcher, not a worker
        try:
            if own_uts and os.readlink(f"/proc/{proc.pid}/ns/uts") != own_uts:
                continue
            rank = int(env["RANK"])
        except (OSError, ValueError):
            continue
        # A worker's own children (data loader workers, compile helpers) inherit RANK: keep the eldest.
        if rank not in found or proc.create_time() < found[rank][0].create_time():
            found[rank] = (proc, int(env.get(NODE_RANK_ENV, "-1") or -1))
    return found


def _forked_ranks(run_dir: str, attempt: int, own_uts: str) -> dict[int, Any]:
    """Ranks the direct launcher forked on this node, from the pids it recorded (their
    ``/proc/<pid>/environ`` is the launcher's): alive, in this node's namespace, its children."""
    import json

    import psutil

    from orchestrator.contract.run_dir import NODE_RANKS_RE, attempt_dir, rank_pids_file

    found: dict[int, Any] = {}
    folder = attempt_dir(Path(run_dir), attempt)
    try:
        entries = [e for e in os.scandir(folder) if NODE_RANKS_RE.match(e.name)]
    except OSError:
        return found
    for entry in entries:
        node = int(NODE_RANKS_RE.match(entry.name).group(1))  # type: ignore[union-attr]
        try:
            record = json.loads(rank_pids_file(Path(entry.path)).read_text())
        except (OSError, ValueError):
            continue
        for rank, pid in record.get("ranks", {}).items():
            try:
                proc = psutil.Process(int(pid))
                if proc.ppid() != int(record["launcher"]):
                    continue  # gone, and the pid reused
                if own_uts and os.readlink(f"/proc/{pid}/ns/uts") != own_uts:
                    continue
            except (psutil.Error, OSError, ValueError, KeyError):
                continue
            found[int(rank)] = (proc, node)
    return found


def dump_one(rank: int, proc: Any, node: int, out_dir: Path) -> dict[str, Any]:
    """Dump one rank's stacks into ``rank_<R>.txt``; return its evidence record."""
    import psutil

    try:
        state = proc.status()
        cpu = proc.cpu_times()
        cpu_s: float | None = cpu.user + cpu.system
    except psutil.Error:
        state, cpu_s = "gone", None
    at = time.monotonic()  # one clock per machine: a rank's two dumps are taken on its own node
    tool = py_spy()
    if tool is None:
        text, how = "py-spy is not installed on this node (pip install 'orchestrator[train]')", "none"
    else:
        try:
            res = subprocess.run(
                [tool, "dump", "--nonblocking", "--pid", str(proc.pid)],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            text, how = (res.stdout + res.stderr).strip(), "py-spy"
        except (subprocess.TimeoutExpired, OSError) as exc:
            text, how = f"py-spy failed: {exc}", "none"
    host = socket.gethostname()
    header = f"rank {rank} node {node} host {host} pid {proc.pid} state {state} (collected by {how})\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    rank_stack_file(out_dir, rank).write_text(header + text + "\n")
    return {
        "rank": rank,
        "node": node,
        "host": host,
        "pid": proc.pid,
        "state": state,
        "in_collective": bool(COLLECTIVE_FRAME_RE.search(text)),
        "stack_tail": [line.strip() for line in text.splitlines() if line.startswith("    ")][:3],
        "cpu_s": cpu_s,
        "at": at,
    }


def collect_here(run_dir: str, attempt: int, out_dir: Path) -> list[dict[str, Any]]:
    procs = rank_processes(run_dir, attempt)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(procs)))) as pool:
        return list(
            pool.map(lambda item: dump_one(item[0], item[1][0], item[1][1], out_dir), sorted(procs.items()))
        )


def node_side_argv(python: str, run_dir: Path, attempt: int, out_dir: Path) -> list[str]:
    return [python, "-m", "orchestrator.supervise.stacks", "--here", str(run_dir), str(attempt), str(out_dir)]


def collect(
    node_prefix: list[str], run_dir: Path, attempt: int, out_dir: Path, timeout_s: float = COLLECT_TIMEOUT_S
) -> tuple[list[dict[str, Any]], str]:
    """Run the node side on every node through ``node_prefix`` (one task per node, ``--overlap``);
    return the ranks' evidence and the node command's complaints (empty when none)."""
    argv = [*node_prefix, *node_side_argv(sys.executable, run_dir, attempt, out_dir)]
    try:
        res = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return [], f"stack collection took over {timeout_s:.0f} s"
    except OSError as exc:
        return [], f"the node command could not run: {exc}"
    records = []
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return sorted(records, key=lambda r: r["rank"]), "" if res.returncode == 0 else res.stderr.strip()[-500:]


def find_culprit(
    evidence: list[dict[str, Any]],
    heartbeats: dict[int, dict[str, Any]],
    world_size: int | None = None,
    stalled: bool = True,
) -> tuple[int, str, str] | None:
    """Pure: ``(rank, host, why)`` of the one rank that differs from the others, or None when no
    single rank does. In order of certainty: a rank whose process is stopped or gone; a rank that
    was expected (heartbeat) but has no process; the one rank behind the others' step or in another
    phase; the one rank that is not inside a collective.

    The last two mean something only for ranks that are not moving (``stalled``: the hang watchdog's
    case, or two dumps alike, :func:`unchanged`): a healthy job has, at any instant, ranks inside an
    all-reduce and one still computing its way to it."""
    by_rank = {e["rank"]: e for e in evidence}
    dead = [e for e in evidence if e.get("state") in DEAD_STATES]
    if len(dead) == 1:
        e = dead[0]
        return e["rank"], e["host"], f"its process is {e['state']} (pid {e['pid']})"
    expected = set(heartbeats) | (set(range(world_size)) if world_size else set())
    missing = sorted(expected - set(by_rank)) if by_rank else []
    if len(missing) == 1:
        r = missing[0]
        return r, str(heartbeats.get(r, {}).get("host", "?")), "no training process for it on its node"
    if not stalled:
        return None
    if len(heartbeats) >= 2:
        where = {r: (h.get("step"), h.get("phase")) for r, h in heartbeats.items()}
        common, count = Counter(where.values()).most_common(1)[0]
        if count == len(where) - 1:
            (r,) = [r for r, w in where.items() if w != common]
            return (
                r,
                str(heartbeats[r].get("host", "?")),
                f"at step {where[r][0]} phase {where[r][1]} while the others are at step {common[0]} "
                f"phase {common[1]}",
            )
    outside = [e for e in evidence if not e.get("in_collective")]
    if len(evidence) >= 2 and len(outside) == 1:
        e = outside[0]
        return e["rank"], e["host"], "the only rank not inside a collective"
    return None


#: A rank outside a collective that used at least this share of one core between two dumps is
#: computing, not stuck (:func:`unchanged`): a stopped rank uses next to none (a timer thread's few
#: milliseconds); a computing one on a machine loaded five times over its cores still gets ~20 %.
BUSY_SHARE = 0.05


def unchanged(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> bool:
    """Pure: whether two dumps of the same ranks show every one of them where it was (same process,
    same innermost frames, same side of a collective) and no rank outside a collective computing
    between them: ranks that are not moving.

    Why the CPU time: the same frames twice do not mean a rank stood still. A healthy job whose one
    rank computes longer than the others (its loop on one line, its layers all ``Linear.forward``)
    is caught there in both dumps, the others waiting for it in the all-reduce, and was reported as
    "rank 1 differs". A rank stuck outside a collective (a deadlock, a sleep, a hung read) uses next
    to no CPU; one that used :data:`BUSY_SHARE` of a core between the dumps is working (one spinning
    in a loop it never leaves is too, to this test: the hang watchdog's heartbeats name that one).
    Ranks inside a collective are not asked: NCCL's waiting ranks spin a core."""

    def where(records: list[dict[str, Any]]) -> dict[int, tuple[Any, ...]]:
        return {
            r["rank"]: (r.get("pid"), r.get("in_collective"), tuple(r.get("stack_tail") or ()))
            for r in records
        }

    if not first or where(first) != where(second):
        return False
    before = {r["rank"]: r for r in first}
    return not any(_busy(before[r["rank"]], r) for r in second if not r.get("in_collective"))


def _busy(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether a rank used at least :data:`BUSY_SHARE` of a core between its two records (False when
    a record has no CPU time: a dump by an older node side, or a process gone)."""
    values = [r.get(key) for r in (first, second) for key in ("cpu_s", "at")]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return False
    cpu0, at0, cpu1, at1 = (float(v) for v in values)  # type: ignore[arg-type]
    return at1 > at0 and cpu1 - cpu0 >= BUSY_SHARE * (at1 - at0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.supervise.stacks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--here", nargs=3, metavar=("RUN_DIR", "ATTEMPT", "OUT_DIR"), required=True)
    args = parser.parse_args(argv)
    run_dir, attempt, out_dir = args.here
    for record in collect_here(run_dir, int(attempt), Path(out_dir)):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
