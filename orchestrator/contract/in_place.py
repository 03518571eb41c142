"""The files of a restart in place, in an attempt's folder (``logs/attempt_<A>/``): a node's mark that
its launcher outlived its failed ranks, and the batch step's word to such nodes.

Writers: the node entry (``orchestrator.node.restart_in_place``) and the batch step
(``orchestrator.schedulers.slurm.in_place``); ``status`` and the failure report read the attempt
folder as before (a kept node's exit file is written as any other).
"""

from __future__ import annotations

from pathlib import Path

#: The batch step's word: ``{"attempt": N}`` (start the ranks again as attempt N) or
#: ``{"attempt": null, "why": ...}`` (end the node's task).
NEXT_ATTEMPT_FILE = "next_attempt.json"


def node_kept_file(attempt_path: Path, node: int) -> Path:
    """Written before ``node_<N>.exit`` by a node whose launcher outlived its failed ranks and waits
    for :func:`next_attempt_file`: its ranks can be started again in place."""
    return Path(attempt_path) / f"node_{node}.kept"


def next_attempt_file(attempt_path: Path) -> Path:
    return Path(attempt_path) / NEXT_ATTEMPT_FILE
