"""The test cluster's GRES GPUs as its own configuration says (``start_cluster.sh``'s ``GPU_NODES``):
the truth that ``profiles init`` and ``doctor`` are held to, read from the files Slurm reads, never
from the code under test."""

from __future__ import annotations

import re

from tests.helpers.preconditions import require
from tests.helpers.slurm_cluster import require_cluster, slurm


def gres_truth() -> tuple[list[str], str, int]:
    """The nodes with GRES GPUs, their type and count per node: each ``NodeName=... Gres=gpu:TYPE:N``
    line of slurm.conf, checked against gres.conf (its nodes expanded by ``scontrol show hostnames``,
    one ``File=`` per GPU)."""
    etc = require_cluster().base / "etc"
    found = re.findall(r"^NodeName=(\S+) .*\bGres=gpu:(\w+):(\d+)", (etc / "slurm.conf").read_text(), re.M)
    require(len(found) >= 2, "two nodes with GRES GPUs (start_cluster.sh GPU_NODES >= 2)")
    assert len({(kind, count) for _, kind, count in found}) == 1, found
    nodes, kind, count = [n for n, _, _ in found], found[0][1], int(found[0][2])
    line = next(x for x in (etc / "gres.conf").read_text().splitlines() if x.startswith("NodeName="))
    fields = dict(word.split("=", 1) for word in line.split())
    assert slurm("scontrol", "show", "hostnames", fields["NodeName"]).stdout.split() == nodes, line
    assert fields["Type"] == kind and fields["Name"] == "gpu", line
    assert len(slurm("scontrol", "show", "hostnames", fields["File"]).stdout.split()) == count, line
    return nodes, kind, count
