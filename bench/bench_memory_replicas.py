"""What a copy of every memory checkpoint on the next node costs a save: node-local memory checkpoints
(the baseline commit) against the same with each rank's file sent to the next node (this tree), with
no memory checkpoints as the floor, in one invocation.

``train/`` (``--preset``, synthetic data, FSDP ``full_shard``, ``--nodes`` simulated nodes of one rank
on ``--profile local``, a memory checkpoint at every step) runs three times in turn, as
``bench/bench_memory_checkpoints_ddp.py`` runs it (the same measure: the median step's wall time, the
save its excess over the floor; the memory folders' peak bytes):

* ``none``: this tree, ``--memory-ckpt-every 0``;
* ``node-local``: the baseline commit (``--baseline``, a ``git worktree``): each rank's file in its
  own node's folder only;
* ``with a copy``: this tree: each rank's file also goes to the next node (gloo, point to point).

The simulated nodes share this machine, so the copy crosses loopback, not a fabric: on a cluster it
costs the shard's bytes over the node's link (at 25 GB/s, a 2 GB shard is 0.08 s)::

    .venv/bin/python bench/bench_memory_replicas.py --nodes 2

Writes ``bench/results_memory_replicas.json`` and prints the rows for ``bench/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_goodput import REPO
from bench_memory_checkpoints_ddp import against_baseline

#: The last commit whose memory checkpoints stayed on their own node.
BASELINE = "f7519d0"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--out", default=str(REPO / "bench" / "results_memory_replicas.json"))
    opts = ap.parse_args()
    opts.strategy, opts.ranks = "full_shard", 1
    rows = against_baseline(opts, "node-local", "with a copy")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "preset": opts.preset,
        "nodes": opts.nodes,
        "baseline": opts.baseline,
        "load": round(os.getloadavg()[0], 1),
        "rows": rows,
        "bytes with a copy / node-local": round(
            rows["with a copy"]["peak_node_bytes"] / max(rows["node-local"]["peak_node_bytes"], 1), 2
        ),
        "save with a copy - node-local (s)": round(
            rows["with a copy"]["save_s"] - rows["node-local"]["save_s"], 3
        ),
    }
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
