"""The batch step's side of a restart in place (the nodes' side: ``orchestrator.node.restart_in_place``).

In a step marked with ``RESTART_IN_PLACE_ENV`` a node whose ranks failed does not end its task: it
writes ``node_<N>.kept`` and its exit file, and waits. Once every node of the step has done so, the
attempt has ended as surely as if srun had returned (every rank is gone; the logs are complete), and
the batch step decides as it always did; its word goes into the attempt's folder: the next attempt
(the nodes fork its ranks from the launchers they kept) or none (the tasks end, srun returns, and
the step ends the old way). A node that could not keep its launcher (DeepSpeed goes through
torchrun; a launcher that died) ends its task instead, srun's kill-on-bad-exit ends the others and
the batch step restarts with a new step, as before.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from orchestrator.contract.in_place import ended_in_place, stop_ranks_file
from orchestrator.contract.run_dir import attempt_dir, read_current_plan_json, write_json_atomic

#: After the stop word, how long the nodes have to end their ranks and keep their launchers before
#: the step is ended the old way (a node that does not answer is then restarted as a new step).
STOP_WAIT_S = 30.0


def planned_nodes(run_dir: Path) -> int:
    """The step's node count as planned (a step without spare nodes runs on every node it holds)."""
    nodes = read_current_plan_json(run_dir).get("nodes")
    return nodes if isinstance(nodes, int) and nodes > 0 else 1


def until_srun_ends(watch: Any, notifier: Any) -> int:
    """srun's status once the nodes told to end have ended their tasks."""
    status = None
    while status is None:
        status = watch.wait(0.5)
        notifier.poll()
    watch.finish()
    return 128 - status if status < 0 else status


def stop_in_place(
    watch: Any, run_dir: Path, attempt: int, nodes: int, why: str, wait_s: float = STOP_WAIT_S
) -> int | None:
    """A hung attempt, its stacks saved: every node is told to end its ranks and keep its launcher
    (``stop_ranks.json``), as a restart in place needs; the attempt's first non-zero exit code once
    every node kept its launcher, or None (srun ended, or a node did not answer within ``wait_s``):
    the caller then ends the step."""
    write_json_atomic(stop_ranks_file(attempt_dir(run_dir, attempt)), {"why": why})
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if watch.wait(0.1) is not None:
            return None
        code, _ = ended_in_place(run_dir, attempt, nodes)
        if code is not None:
            return code
    return None
