"""The hang watchdog: a job whose ranks stop making progress ends within ``hang_timeout``, with
every rank's stack saved and the rank that differs named, instead of burning its allocation until
the collective times out (gloo 30 min, NCCL 10 min) or the time limit.

It runs in the batch step's supervisor (:mod:`orchestrator.schedulers.slurm.batch_step`), on the batch host, and
reads the ranks' heartbeats (:mod:`orchestrator.contract.heartbeat`) from the shared run directory. Progress
is any rank's ``(step, phase)`` changing. The allowance is longer when a slow phase is legitimate:
until every rank finished its first step (start-up, compilation, a restore) and while any rank
checkpoints. Without ``hang_timeout`` it is derived from the step times the ranks report. A script
without heartbeats is not watched (``status`` shows its time since the last output, and
``orchestrator stacks`` dumps it on demand).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.heartbeat import read_heartbeats, stragglers
from orchestrator.contract.run_dir import attempt_dir

#: The allowance before the first step finished everywhere, as a multiple of the timeout.
FIRST_STEP_FACTOR = 5.0
#: The allowance while any rank is in the checkpoint phase, as a multiple of the timeout.
CHECKPOINT_FACTOR = 10.0
#: Without ``hang_timeout``: this many median step times, and never less than the floor.
DERIVED_STEPS = 20.0
DERIVED_FLOOR_S = 300.0
#: How often the supervisor reads the heartbeats.
POLL_S = 1.0
#: A rank named a straggler is named again at most this often, with how often it was flagged
#: meanwhile: on a loaded machine ranks take turns being slow, and the chaos benchmark's log got
#: a straggler line every 3-10 s.
STRAGGLER_REPEAT_S = 300.0


@dataclass
class Hang:
    """What the watchdog saw when it fired."""

    timeout_s: float
    stalled_s: float
    why_longer: str
    heartbeats: dict[int, dict[str, Any]] = field(default_factory=dict)

    def describe(self) -> str:
        where = ", ".join(
            f"rank {r} step {h.get('step')} {h.get('phase')}" for r, h in sorted(self.heartbeats.items())
        )
        return f"no progress for {self.stalled_s:.0f} s (timeout {self.timeout_s:.0f} s{self.why_longer}): {where}"


class Watchdog:
    """Polled by the supervisor; :meth:`check` returns a :class:`Hang` once the ranks stalled."""

    def __init__(
        self,
        run_dir: Path,
        attempt: int,
        hang_timeout: float | None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.attempt_path = attempt_dir(run_dir, attempt)
        self.hang_timeout = hang_timeout
        self.say = say
        self.flagged: set[int] = set()
        """Ranks flagged as stragglers at the last look."""
        self._said: dict[int, float] = {}
        self._unsaid: dict[int, int] = {}
        self._key: tuple[Any, ...] | None = None
        self._changed = time.monotonic()
        self._next_poll = 0.0

    def allowance(self, heartbeats: dict[int, dict[str, Any]]) -> tuple[float, str]:
        """Pure given the heartbeats: the timeout now, and why it is longer than the base one."""
        step_times = [float(h["step_s"]) for h in heartbeats.values() if h.get("step_s")]
        if self.hang_timeout:
            base = float(self.hang_timeout)
        else:
            base = max(DERIVED_FLOOR_S, DERIVED_STEPS * statistics.median(step_times) if step_times else 0.0)
        if any(h.get("phase") == "checkpoint" for h in heartbeats.values()):
            return base * CHECKPOINT_FACTOR, ", longer: a rank is checkpointing"
        if not step_times or any(h.get("step_s") is None for h in heartbeats.values()):
            return base * FIRST_STEP_FACTOR, ", longer: the first step"
        return base, ""

    def check(self, now: float | None = None) -> Hang | None:
        now = time.monotonic() if now is None else now
        if now < self._next_poll:
            return None
        self._next_poll = now + POLL_S
        heartbeats = read_heartbeats(self.attempt_path)
        if not heartbeats:
            self._changed = now  # nothing to watch yet (or a script without heartbeats)
            return None
        key = tuple(sorted((r, h.get("step"), h.get("phase")) for r, h in heartbeats.items()))
        if key != self._key:
            self._key, self._changed = key, now
            self.note_stragglers(heartbeats, now)
            return None
        timeout, why = self.allowance(heartbeats)
        stalled = now - self._changed
        if stalled < timeout:
            return None
        return Hang(timeout, stalled, why, heartbeats)

    def note_stragglers(self, heartbeats: dict[int, dict[str, Any]], now: float) -> None:
        """Say each rank newly flagged as a straggler; the same rank again only after
        :data:`STRAGGLER_REPEAT_S`, with how many times it was flagged in between."""
        found = stragglers(heartbeats)
        flagged = set(found.flagged) if found else set()
        if found and self.say is not None:
            for rank in sorted(flagged - self.flagged):
                last = self._said.get(rank)
                if last is not None and now - last < STRAGGLER_REPEAT_S:
                    self._unsaid[rank] = self._unsaid.get(rank, 0) + 1
                    continue
                rec = heartbeats[rank]
                also = self._unsaid.pop(rank, 0)
                self._said[rank] = now
                self.say(
                    f"straggler: rank {rank} on {rec.get('host')} (node {rec.get('node')}) took "
                    f"{rec.get('recent')} s per step outside collectives, median of the others "
                    f"{found.median_local_s:.4f} s"
                    + (f" (flagged {also} more time(s) since it was last named)" if also else "")
                )
        self.flagged = flagged


# ------------------------------------------------------------------------------ after it fired
def node_name(rank: int, evidence: list[dict[str, Any]], hang: Hang, nodes: list[str], host: str) -> str:
    """The scheduler's name for the node of ``rank``: its node rank indexes the allocation's node list
    (hostnames need not be node names)."""
    node = next((e.get("node") for e in evidence if e.get("rank") == rank), None)
    if not isinstance(node, int) or node < 0:
        node = hang.heartbeats.get(rank, {}).get("node")
    if isinstance(node, int) and 0 <= node < len(nodes):
        return nodes[node]
    return host


def write_report(folder: Path, report: dict[str, Any]) -> None:
    from orchestrator.contract.run_dir import HANG_REPORT_FILE, write_json_atomic

    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / HANG_REPORT_FILE, report, indent=1)


def investigate(
    run_dir: Path,
    attempt: int,
    hang: Hang,
    nodes: list[str],
    node_prefix: list[str],
    world_size: int | None,
) -> tuple[str, str | None]:
    """Collect every rank's stacks into ``hang/attempt_<A>/``, find the rank that differs, write
    ``hang.json``; return the job's reason and the node to leave out (None: no single one).
    ``node_prefix``: the scheduler's command that runs one task on each of ``nodes``
    (:meth:`~orchestrator.schedulers.base.Scheduler.on_every_node`)."""
    from orchestrator.contract.run_dir import hang_dir
    from orchestrator.supervise.stacks import collect, find_culprit

    folder = hang_dir(run_dir, attempt)
    started = time.monotonic()
    evidence, problem = collect(node_prefix, run_dir, attempt, folder)
    culprit = find_culprit(evidence, hang.heartbeats, world_size)
    bad_node = None
    reason = f"hang: {hang.describe()}"
    if culprit is not None:
        rank, host, why = culprit
        bad_node = node_name(rank, evidence, hang, nodes, host)
        reason += f"; rank {rank} on node {bad_node} differs: {why}"
    else:
        reason += "; no single rank differs"
    reason += f"; stacks of {len(evidence)} rank(s) in {folder}"
    write_report(
        folder,
        {
            "reason": reason,
            "bad_node": bad_node,
            "culprit_rank": culprit[0] if culprit else None,
            "timeout_s": hang.timeout_s,
            "stalled_s": round(hang.stalled_s, 1),
            "heartbeats": {str(r): h for r, h in sorted(hang.heartbeats.items())},
            "ranks": evidence,
            "collection_problem": problem,
            "collection_s": round(time.monotonic() - started, 2),
            "time": time.time(),
        },
    )
    return reason, bad_node
