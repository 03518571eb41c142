"""The preflight's decision (orchestrator.supervise.preflight.judge) on synthetic figures: which node it names.

The figures are what the nodes' reports hold (``node_<N>.json``); the real measurement runs on the
Slurm test cluster in tests/cluster/test_preflight.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.config.profile.records import Preflight
from orchestrator.supervise.preflight import judge

LIMITS = Preflight.model_validate({"max_latency_ms": 20.0, "min_bandwidth_mbps": 200.0})
GOOD = {"rtt_ms": 0.4, "in_mbps": 3000.0}


def reports(n: int, links: dict[int, tuple[float, float, float]] | None = None) -> dict[int, dict[str, Any]]:
    """``links``: node rank -> (round trip ms, node 0 -> it Mbit/s, it -> node 0 Mbit/s); others good."""
    links = links or {}
    out: dict[int, dict[str, Any]] = {0: {"problems": [], "peers": {}}}
    for rank in range(1, n):
        rtt, down, up = links.get(rank, (GOOD["rtt_ms"], GOOD["in_mbps"], GOOD["in_mbps"]))
        out[rank] = {"problems": [], "peers": {"0": {"rtt_ms": rtt, "in_mbps": down}}}
        out[0]["peers"][str(rank)] = {"in_mbps": up}
    return out


NODES3 = ["n1", "n2", "n3"]


def test_all_good_passes() -> None:
    verdict = judge(NODES3, reports(3), LIMITS, timed_out=False)
    assert not verdict.failed and verdict.bad_nodes == [] and len(verdict.links) == 2


@pytest.mark.parametrize(
    ("link", "words"),
    [
        ((0.4, 30.0, 30.0), "n1 -> n3 30.0 Mbit/s < 200"),  # slow both ways
        ((0.4, 3000.0, 30.0), "n3 -> n1 30.0 Mbit/s < 200"),  # its egress only
        ((210.0, 3000.0, 3000.0), "round trip 210.0 ms > 20 ms"),  # a delayed link
    ],
)
def test_three_nodes_the_slow_pair_names_its_other_end(link: tuple[float, float, float], words: str) -> None:
    verdict = judge(NODES3, reports(3, {2: link}), LIMITS, timed_out=False)
    assert verdict.failed and verdict.bad_nodes == ["n3"], verdict
    assert "node n3: its link to n1 is slow" in verdict.reason and words in verdict.reason, verdict.reason


def test_every_pair_slow_names_node_zero() -> None:
    slow = (0.4, 3000.0, 20.0)
    verdict = judge(["a", "b", "c", "d"], reports(4, {1: slow, 2: slow, 3: slow}), LIMITS, timed_out=False)
    assert verdict.bad_nodes == ["a"] and "every other node's link to it is slow" in verdict.reason


def test_two_nodes_the_direction_names_the_node() -> None:
    up_slow = judge(["n1", "n2"], reports(2, {1: (0.4, 3000.0, 25.0)}), LIMITS, timed_out=False)
    assert up_slow.bad_nodes == ["n2"] and "node n2: its outgoing link is slow" in up_slow.reason
    down_slow = judge(["n1", "n2"], reports(2, {1: (0.4, 25.0, 3000.0)}), LIMITS, timed_out=False)
    assert down_slow.bad_nodes == ["n1"]
    both = judge(["n1", "n2"], reports(2, {1: (0.4, 25.0, 25.0)}), LIMITS, timed_out=False)
    assert both.failed and both.bad_nodes == [] and "link between n1 and n2" in both.reason


def test_local_problem_and_missing_reports() -> None:
    found = reports(3)
    found[1]["problems"] = ["10 MiB free in /runs, 2048 MiB needed"]
    verdict = judge(NODES3, found, LIMITS, timed_out=False)
    assert verdict.bad_nodes == ["n2"] and "node n2: 10 MiB free" in verdict.reason
    # Timed out: a node that never reported, and the first pair that never finished, are named.
    partial = reports(3)
    del partial[2]
    del partial[0]["peers"]["2"]
    verdict = judge(NODES3, partial, LIMITS, timed_out=True)
    assert verdict.bad_nodes == ["n3"] and "no preflight report" in verdict.reason
    hung = reports(3)
    hung[1]["peers"] = {}
    del hung[0]["peers"]["1"], hung[0]["peers"]["2"]
    del hung[2]["peers"]["0"]
    verdict = judge(NODES3, hung, LIMITS, timed_out=True)
    assert verdict.bad_nodes == ["n2"] and "not measured within the timeout" in verdict.reason
    # The same without a timeout: the step broke by itself; nobody is blamed.
    assert not judge(NODES3, hung, LIMITS, timed_out=False).failed
