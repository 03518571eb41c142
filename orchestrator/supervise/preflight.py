"""Preflight: checks inside the allocation before training, so a bad node ends the job within
seconds, named, instead of burning the allocation until a collective times out.

The batch step's supervisor (:mod:`orchestrator.schedulers.slurm.batch_step`) runs one short step over every
node of the allocation (one task per node, :mod:`orchestrator.node.preflight`), bounded by the
profile's ``preflight.timeout_s``. Each node writes its own results into ``preflight/attempt_<A>/``:

* per node: the run directory is writable and has room for the newest complete checkpoint plus
  ``min_free_mb``; on GPU profiles the GPU count and uncorrected ECC errors (``nvidia-smi``);
* its link to node 0, measured with torch.distributed point-to-point transfers (gloo on CPU, NCCL
  on GPUs): the round trip of a tiny message (at the other node) and a 1 MiB transfer in each
  direction, each timed by its receiver.

Why pairs with node 0 and not one all-reduce: an all-reduce is as slow as its slowest link, so it
tells that a link is bad but not whose. A star of pairs names the node: with 3 or more nodes, the
node whose pair is slow is bad, and when every pair is slow the common end, node 0, is. With 2
nodes only the direction can tell: a slow transfer *from* a node (its egress) names that node; a
link slow both ways (or a slow round trip) is named as the link between the two, with no single
node to leave out. Figures are the best of a few tries: a busy host's noise never fails a good link,
a bad link is bad even at its best. The cost grows with the node count (one pair after another,
milliseconds each on a real interconnect); bench/bench_preflight.py measures it.

:func:`judge` is the decision, pure (tests/supervise/test_preflight.py feeds it synthetic figures).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config.plan import LaunchPlan
    from orchestrator.config.profile.records import Preflight

#: Bytes of one bandwidth transfer, and how many of them each direction gets (the best counts).
PAYLOAD_BYTES = 1 << 20
TRANSFERS = 3
#: Round trips of a tiny message per pair (the best counts).
PINGS = 5
#: After SIGTERM to a preflight step past its timeout, how long its launcher gets to end its tasks.
STOP_GRACE_S = 5.0


@dataclass
class Verdict:
    """What the preflight concluded. ``failed``: the job must not train on this allocation."""

    failed: bool
    reason: str
    bad_nodes: list[str] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)


def _fmt(value: float | None, unit: str) -> str:
    return "none" if value is None else f"{value:.1f} {unit}"


def judge(
    nodes: list[str], reports: dict[int, dict[str, Any]], limits: Preflight, timed_out: bool
) -> Verdict:
    """Pure: every node's report (``node_<N>.json``, by node rank) and the profile's thresholds in,
    the verdict out. ``nodes``: the allocation's node names, in node-rank order."""
    named: dict[str, str] = {}  # node -> why
    for rank, name in enumerate(nodes):
        report = reports.get(rank)
        if report is None:
            if timed_out:
                named[name] = "no preflight report (it did not start within the timeout)"
            continue
        for problem in report.get("problems") or []:
            named[name] = f"{named[name]}; {problem}" if name in named else str(problem)
    links: list[dict[str, Any]] = []
    slow: dict[int, str] = {}
    unfinished: int | None = None
    for rank in range(1, len(nodes)):
        mine = (reports.get(rank) or {}).get("peers", {}).get("0") or {}
        theirs = (reports.get(0) or {}).get("peers", {}).get(str(rank)) or {}
        link: dict[str, Any] = {
            "node": nodes[rank],
            "rtt_ms": mine.get("rtt_ms"),
            "to_node_mbps": mine.get("in_mbps"),  # node 0 -> this node, timed here
            "from_node_mbps": theirs.get("in_mbps"),  # this node -> node 0, timed at node 0
        }
        links.append(link)
        if None in (link["rtt_ms"], link["to_node_mbps"], link["from_node_mbps"]):
            if unfinished is None:
                unfinished = rank  # pairs run in order: the first unfinished one held up the rest
            continue
        why: list[str] = []
        if link["rtt_ms"] > limits.max_latency_ms:
            why.append(f"round trip {_fmt(link['rtt_ms'], 'ms')} > {limits.max_latency_ms:g} ms")
        if link["to_node_mbps"] < limits.min_bandwidth_mbps:
            why.append(
                f"{nodes[0]} -> {nodes[rank]} {_fmt(link['to_node_mbps'], 'Mbit/s')} < {limits.min_bandwidth_mbps:g} Mbit/s"
            )
        if link["from_node_mbps"] < limits.min_bandwidth_mbps:
            why.append(
                f"{nodes[rank]} -> {nodes[0]} {_fmt(link['from_node_mbps'], 'Mbit/s')} < {limits.min_bandwidth_mbps:g} Mbit/s"
            )
        if why:
            slow[rank] = ", ".join(why)
    if unfinished is not None and timed_out and nodes[unfinished] not in named:
        named[nodes[unfinished]] = f"its link to {nodes[0]} was not measured within the timeout"
    ambiguous = ""
    if len(nodes) >= 3 and slow and len(slow) == len(nodes) - 1:
        named.setdefault(nodes[0], "every other node's link to it is slow: " + "; ".join(slow.values()))
    elif len(nodes) == 2 and slow:
        pair = links[0]
        out_slow = pair["from_node_mbps"] < limits.min_bandwidth_mbps
        in_slow = pair["to_node_mbps"] < limits.min_bandwidth_mbps
        if out_slow and not in_slow and pair["rtt_ms"] <= limits.max_latency_ms:
            named.setdefault(nodes[1], f"its outgoing link is slow: {slow[1]}")
        elif in_slow and not out_slow and pair["rtt_ms"] <= limits.max_latency_ms:
            named.setdefault(nodes[0], f"its outgoing link is slow: {slow[1]}")
        else:
            ambiguous = (
                f"the link between {nodes[0]} and {nodes[1]} is slow ({slow[1]}); no single node to leave out"
            )
    else:
        for rank, text in slow.items():
            named.setdefault(nodes[rank], f"its link to {nodes[0]} is slow: {text}")
    bad = [n for n in nodes if n in named]
    parts = [f"node {n}: {named[n]}" for n in bad] + ([ambiguous] if ambiguous else [])
    if not parts:
        return Verdict(False, "preflight passed", [], links)
    return Verdict(True, "preflight failed: " + "; ".join(parts), bad, links)


def preflight_step(node_prefix: list[str], attempt: int) -> list[str]:
    """The preflight's step: through ``node_prefix`` (the scheduler's one task per node), each task
    running :mod:`orchestrator.node.preflight`."""
    return [*node_prefix, sys.executable, "-m", "orchestrator.node.preflight", str(attempt)]


def _run_bounded(argv: list[str], timeout_s: float) -> bool:
    """Run the step; past the timeout its launcher gets SIGTERM (it ends its tasks), then SIGKILL.
    True: timed out."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return True


def run_preflight(
    run_dir: Path,
    attempt: int,
    plan: LaunchPlan,
    nodes: list[str],
    node_prefix: list[str],
    say: Callable[[str], None],
) -> Verdict | None:
    """Run the checks over ``nodes``, write ``preflight.json``; None when the profile turns them off.
    An inconclusive preflight (the step itself broke, nobody to blame) lets training start: it
    would only ever block a job that might be fine."""
    from orchestrator.contract.run_dir import (
        PREFLIGHT_REPORT_FILE,
        preflight_dir,
        read_json,
        write_json_atomic,
    )

    limits = plan.profile.preflight
    if not limits.enabled:
        return None
    folder = preflight_dir(run_dir, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say(f"preflight on {len(nodes)} node(s) (timeout {limits.timeout_s} s)")
    timed_out = _run_bounded(preflight_step(node_prefix, attempt), limits.timeout_s)
    reports: dict[int, dict[str, Any]] = {}
    for rank in range(len(nodes)):
        report = read_json(folder / f"node_{rank}.json")
        if report is not None:
            reports[rank] = report
    verdict = judge(nodes, reports, limits, timed_out)
    elapsed = time.monotonic() - started
    if not verdict.failed and not reports:
        verdict.reason = "preflight inconclusive: no node reported (the step itself failed); training anyway"
    with contextlib.suppress(OSError):
        write_json_atomic(
            folder / PREFLIGHT_REPORT_FILE,
            {
                "failed": verdict.failed,
                "reason": verdict.reason,
                "bad_nodes": verdict.bad_nodes,
                "nodes": nodes,
                "links": verdict.links,
                "timed_out": timed_out,
                "seconds": round(elapsed, 2),
                "limits": limits.model_dump(),
                "time": time.time(),
            },
            indent=1,
        )
    say(f"{verdict.reason} ({elapsed:.1f} s)")
    return verdict
