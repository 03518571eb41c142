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

from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import read_current_plan_json


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
