"""The files of a restart in place, in an attempt's folder (``logs/attempt_<A>/``): a node's mark that
its launcher outlived its failed ranks, and the word of the one who decides (the batch step, or a local
job's node 0) to such nodes.

Writers: the node entry (``orchestrator.node.restart_in_place``) and the one that decides: the batch
step on Slurm (``orchestrator.schedulers.slurm.batch_step``), node 0 of a local job
(``orchestrator.schedulers.local.in_allocation``); ``status`` and the failure report read the attempt
folder as before (a kept node's exit file is written as any other).
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.contract.run_dir import attempt_dir, node_exit_file, write_json_atomic
from orchestrator.contract.shared_fs import listed, read_text_listed

#: The decider's word: ``{"attempt": N}`` (start the ranks again as attempt N) or
#: ``{"attempt": null, "why": ...}`` (end the node's task).
NEXT_ATTEMPT_FILE = "next_attempt.json"


#: The batch step's word to stop the ranks and keep the launchers (the hang watchdog fired and the
#: stacks are saved): ``{"why": ...}``. Each node ends its ranks as after a failed peer, keeps its
#: launcher and waits for :data:`NEXT_ATTEMPT_FILE`.
STOP_RANKS_FILE = "stop_ranks.json"


def node_kept_file(attempt_path: Path, node: int) -> Path:
    """Written before ``node_<N>.exit`` by a node whose launcher outlived its failed ranks and waits
    for :func:`next_attempt_file`: its ranks can be started again in place."""
    return Path(attempt_path) / f"node_{node}.kept"


def next_attempt_file(attempt_path: Path) -> Path:
    return Path(attempt_path) / NEXT_ATTEMPT_FILE


def stop_ranks_file(attempt_path: Path) -> Path:
    return Path(attempt_path) / STOP_RANKS_FILE


def ended_in_place(run_dir: Path, attempt: int, nodes: int) -> tuple[int | None, bool]:
    """(The attempt's first non-zero node exit code once every node of the step kept its launcher and
    wrote its exit file, else None; whether any node kept its launcher). A node that never does
    while others wait may be lost: the batch step (Slurm) probes the nodes then, as for a failed task. A
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
