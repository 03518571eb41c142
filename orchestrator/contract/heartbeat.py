"""Per-rank heartbeats: where each training process is (step, phase, time), for the hang watchdog,
``status`` and straggler detection.

Standard library only: ``train/``, the user-script API and the Trainer callback import it on every
rank. Why one small file per rank, rewritten in place (``os.pwrite`` of a fixed-size record at
offset 0, never fsync): a beat must cost microseconds (it runs five times a step), readers on
another node of a shared filesystem only need the newest record, and a rank that is killed leaves
its last words behind. A reader can see a torn record while a write is in flight; it then reads
again (:func:`read_heartbeat`).

The record: ``{"rank", "node", "host", "pid", "step", "phase", "time", "step_s", "local_s",
"recent"}``; ``step_s`` is the wall time of the last finished step, ``local_s`` its time in the
phases that wait for no other rank (``data`` and ``forward``), ``recent`` the last
:data:`RECENT_STEPS` values of ``local_s`` (the straggler test).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.env import ATTEMPT_ENV, NODE_RANK_ENV, RUN_DIR_ENV
from orchestrator.contract.run_dir import attempt_dir, heartbeat_dir, heartbeat_file

#: The phases a rank reports, in the order a step goes through them.
PHASES = ("data", "forward", "backward", "optimizer", "checkpoint")
#: Phases in which a rank waits for no other rank (in DDP/FSDP the collectives come in backward and
#: after): their time tells a slow rank from one that waits for a slow rank.
LOCAL_PHASES = frozenset({"data", "forward"})
#: How many of a rank's last steps the straggler test looks at.
RECENT_STEPS = 5
#: A rank whose last :data:`RECENT_STEPS` local times are all above this many times the other ranks'
#: median is a straggler.
STRAGGLER_FACTOR = 2.0
#: Size of one record on disk: a rewrite is a single page-cache write of constant size.
RECORD_BYTES = 512


class Heartbeat:
    """One rank's heartbeat writer. ``beat`` is cheap: one ``json.dumps`` and one ``pwrite``."""

    def __init__(self, path: Path, rank: int, node: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # The job's umask decides (0600, or 0640 with share_with_group): status may run as a group member.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        self._base = {"rank": rank, "node": node, "host": os.uname().nodename, "pid": os.getpid()}
        self._step = -1
        self._step_started = 0.0
        self._phase = ""
        self._phase_started = 0.0
        self._local = 0.0
        self._step_s: float | None = None
        self._local_s: float | None = None
        self._recent: list[float] = []

    @classmethod
    def for_this_rank(cls) -> Heartbeat | None:
        """The heartbeat of this process when orchestrator launched it; None otherwise (a plain
        ``python script.py`` or ``accelerate launch`` outside orchestrator)."""
        env = os.environ
        try:
            run_dir = env[RUN_DIR_ENV]
            attempt = int(env[ATTEMPT_ENV])
            rank = int(env["RANK"])
            node = int(env.get(NODE_RANK_ENV, "0"))
        except (KeyError, ValueError):
            return None
        try:
            return cls(heartbeat_file(attempt_dir(Path(run_dir), attempt), rank), rank, node)
        except OSError:
            return None  # a heartbeat must never stop training

    def beat(self, step: int, phase: str) -> None:
        """This rank is now at ``step`` in ``phase`` (one of :data:`PHASES`)."""
        now = time.time()
        if self._phase in LOCAL_PHASES:
            self._local += now - self._phase_started
        if step != self._step:
            if self._step >= 0 and step == self._step + 1:
                self._step_s = now - self._step_started
                self._local_s = self._local
                self._recent = [*self._recent[-(RECENT_STEPS - 1) :], round(self._local, 6)]
            self._step, self._step_started, self._local = step, now, 0.0
        self._phase, self._phase_started = phase, now
        record = {
            **self._base,
            "step": step,
            "phase": phase,
            "time": now,
            "step_s": self._step_s,
            "local_s": self._local_s,
            "recent": self._recent,
        }
        data = json.dumps(record).encode()
        try:
            os.pwrite(self._fd, data.ljust(RECORD_BYTES), 0)
        except OSError:
            pass

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ reading
def read_heartbeat(path: Path) -> dict[str, Any] | None:
    """One rank's newest record, or None. A record torn by a concurrent rewrite is read again."""
    for _ in range(3):
        try:
            with open(path, "rb") as fh:
                raw = fh.read(RECORD_BYTES)
        except OSError:
            return None
        try:
            data = json.loads(raw.decode().strip() or "null")
        except ValueError:
            continue
        return data if isinstance(data, dict) else None
    return None


def read_heartbeats(attempt_path: Path) -> dict[int, dict[str, Any]]:
    """``{rank: record}`` of every rank that has beaten in this attempt."""
    folder = heartbeat_dir(attempt_path)
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith("rank_") and name.endswith(".json"):
            record = read_heartbeat(folder / name)
            if record is not None and isinstance(record.get("rank"), int):
                out[record["rank"]] = record
    return out


@dataclass(frozen=True)
class Stragglers:
    """The slowest rank against the median of the others, from the ranks' local phase times."""

    slowest_rank: int
    slowest_node: int
    slowest_host: str
    slowest_local_s: float
    median_local_s: float
    flagged: list[int]
    """Ranks whose last :data:`RECENT_STEPS` local times all exceed :data:`STRAGGLER_FACTOR` x the median."""

    def to_json(self) -> dict[str, Any]:
        return {
            "slowest_rank": self.slowest_rank,
            "slowest_node": self.slowest_node,
            "slowest_host": self.slowest_host,
            "slowest_local_s": round(self.slowest_local_s, 4),
            "median_local_s": round(self.median_local_s, 4),
            "ratio": round(self.slowest_local_s / self.median_local_s, 2) if self.median_local_s else None,
            "flagged_ranks": self.flagged,
        }


def stragglers(records: dict[int, dict[str, Any]], factor: float = STRAGGLER_FACTOR) -> Stragglers | None:
    """Pure. None with fewer than two ranks that finished a step."""
    typical: dict[int, float] = {}
    for rank, rec in records.items():
        recent = rec.get("recent")
        if isinstance(recent, list) and recent:
            typical[rank] = statistics.median(float(x) for x in recent)
    if len(typical) < 2:
        return None
    slowest = max(typical, key=lambda r: typical[r])
    median = statistics.median(v for r, v in typical.items() if r != slowest)
    flagged = []
    for rank, rec in records.items():
        recent = rec.get("recent") or []
        others = [v for r, v in typical.items() if r != rank]
        if len(recent) >= RECENT_STEPS and others:
            bar = factor * statistics.median(others)
            if all(float(x) > bar for x in recent[-RECENT_STEPS:]):
                flagged.append(rank)
    rec = records[slowest]
    return Stragglers(
        slowest,
        int(rec.get("node", -1)),
        str(rec.get("host", "?")),
        typical[slowest],
        median,
        sorted(flagged),
    )
