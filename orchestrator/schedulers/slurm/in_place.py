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

from orchestrator.contract.in_place import next_attempt_file, node_kept_file
from orchestrator.contract.run_dir import (
    attempt_dir,
    node_exit_file,
    read_current_plan_json,
    write_json_atomic,
)
from orchestrator.contract.shared_fs import listed, read_text_listed


def ended_in_place(run_dir: Path, attempt: int, nodes: int) -> tuple[int | None, bool]:
    """(The attempt's first non-zero node exit code once every node of the step kept its launcher and
    wrote its exit file, else None; whether any node kept its launcher). A node that never does
    while others wait may be lost: the batch step probes the nodes then, as for a failed task. A
    node that ended its task instead (its exit file without the mark, which comes first) leaves
    nothing to restart in place: the nodes that wait are told to end now (say node 0 requeued the
    job at a preemption while node 1's rank died), not after their wait's bound."""
    path = attempt_dir(run_dir, attempt)
    names = listed(path)  # the nodes write these on their hosts (orchestrator.contract.shared_fs)
    codes: list[int] = []
    ended: list[int] = []  # nodes that ended their task
    for node in range(nodes):
        text = read_text_listed(node_exit_file(path, node), names)
        try:
            code = int(text.strip() or 1) if text is not None else None
        except ValueError:
            code = None
        if code is None:
            continue
        kept = node_kept_file(path, node).name in names  # written before the exit file
        if kept:
            codes.append(code)
        else:
            ended.append(node)
    if codes and ended and next_attempt_file(path).name not in names:
        tell_nodes(run_dir, attempt, None, f"node {ended[0]} ended its task")
    if len(codes) < nodes:
        return None, bool(codes)
    return next((code for code in codes if code != 0), 1), True


def tell_nodes(run_dir: Path, attempt: int, following: int | None, why: str = "") -> None:
    """The word to the nodes waiting after ``attempt``: start the ranks again as ``following``, or end."""
    record: dict[str, object] = {"attempt": following}
    if following is None:
        record["why"] = why
    write_json_atomic(next_attempt_file(attempt_dir(run_dir, attempt)), record)


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
