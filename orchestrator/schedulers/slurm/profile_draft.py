"""A Slurm profile drafted from what the cluster says (``orchestrator profiles init``).

Pure: the cluster's facts (:mod:`orchestrator.schedulers.slurm.discover`) and the user's few
answers in, the profile's YAML out, every key with a comment saying where its value came from.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from orchestrator.contract.errors import UserError
from orchestrator.schedulers.slurm.auto_resume import NEW_JOB_FROM_CRED_EXPIRE_S as NEW_JOB_FROM_S
from orchestrator.schedulers.slurm.discover import ClusterFacts, Partition, fast_interface


@dataclass
class Answers:
    """What the cluster cannot say, from flags or prompts."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    setup: list[str] = field(default_factory=list)
    python: str | None = None


def _yaml(value: object) -> str:
    """A scalar as YAML (JSON is YAML: strings quoted, numbers bare)."""
    return json.dumps(value)


def _choose_partition(facts: ClusterFacts, wanted: str | None) -> Partition:
    if not facts.partitions:
        raise UserError(
            "profiles init: the cluster listed no partition ("
            + "; ".join(facts.missing or ["scontrol gave none"])
            + ")"
        )
    if wanted is None:
        return facts.partitions[0]
    for p in facts.partitions:
        if p.name == wanted:
            return p
    known = ", ".join(p.name for p in facts.partitions)
    raise UserError(f"--partition {wanted}: the cluster has no such partition; it has: {known}")


def draft(name: str, facts: ClusterFacts, answers: Answers, when: str | None = None) -> str:
    """The profile's YAML text."""
    part = _choose_partition(facts, answers.partition)
    nodes = [n for n in facts.nodes if n.name in part.nodes] or [
        n for n in facts.nodes if part.name in n.partitions
    ]
    lines = [
        f"# Written by `orchestrator profiles init {name}` on {when or time.strftime('%Y-%m-%d %H:%M')} from what",
        "# the cluster said (scontrol, sacctmgr, srun); the comment on each key says where it came from.",
        "# Check it with `orchestrator profiles validate` and a small job before a long one.",
    ]

    def key(k: str, value: object, why: str) -> None:
        lines.append(f"{k}: {_yaml(value)}  # {why}")

    count = len(part.nodes) or len(nodes)
    cpus = min((n.cpus for n in nodes if n.cpus), default=0)
    mem = min((n.memory_mb for n in nodes if n.memory_mb), default=0)
    gpus = [n.gpus() for n in nodes]
    gpu_count = min((g[0] for g in gpus), default=0)
    gpu_type = next((g[1] for g in gpus if g[1]), None)
    what = f"{count} node(s) x {cpus} CPUs" + (
        f", {gpu_count} GPUs ({gpu_type or 'gpu'})" if gpu_count else ""
    )
    key("description", f"{part.name}: {what}", "from the partition's nodes")
    key("scheduler", "slurm", "sinfo/scontrol answered")
    key(
        "partition",
        part.name,
        "the default partition" if part.default and not answers.partition else "--partition",
    )
    account = (
        answers.account
        or facts.default_account
        or next((a.account for a in facts.associations if a.partition in ("", part.name)), None)
    )
    if account:
        how = "--account" if answers.account else "your default account (sacctmgr)"
        others = sorted({a.account for a in facts.associations} - {account})
        key("account", account, how + (f"; also yours: {', '.join(others)}" if others else ""))
    assoc = [a for a in facts.associations if a.account == account and a.partition in ("", part.name)]
    qos = answers.qos or next((a.default_qos for a in assoc if a.default_qos), None)
    if qos:
        allowed = sorted({q for a in assoc for q in a.qos} - {qos})
        key(
            "qos",
            qos,
            ("--qos" if answers.qos else "the association's default QOS")
            + (f"; also allowed: {', '.join(allowed)}" if allowed else ""),
        )
    if part.max_time:
        key("time_limit", part.max_time, "the partition's MaxTime")
    else:
        key(
            "time_limit",
            "1-00:00:00",
            "the partition has no MaxTime: one day; change it to your jobs' length",
        )
    most = min(count, part.max_nodes) if part.max_nodes else count
    lines.append(
        f"nodes: {{default: {min(2, most)}, max: {most}}}  # the partition's {count} node(s)"
        + (f", MaxNodes {part.max_nodes}" if part.max_nodes else "")
    )
    if gpu_count:
        key("gpus_per_node", gpu_count, "the nodes' GRES")
        if gpu_type:
            # As the cluster spells it: the value goes into --gres, where Slurm matches the type.
            key("gpu_type", gpu_type, "the nodes' GRES type")
        key("exclusive", True, "whole GPU nodes for multi-GPU training")
    if cpus:
        key(
            "cpus_per_task",
            cpus,
            "CPUs of the partition's smallest node (one task per node hosts every rank)",
        )
    if mem:
        key("mem", f"{mem}M", "RealMemory of the partition's smallest node")
    if answers.setup:
        lines.append("setup:  # your answer: the lines that make the nodes' Python")
        lines.extend(f"  - {_yaml(line)}" for line in answers.setup)
    else:
        lines.append(
            "# setup: the lines that make the nodes' Python (module load ..., source .../bin/activate)"
        )
    if answers.python:
        key("python", answers.python, "your answer")
    iface = fast_interface(facts.interfaces)
    if iface:
        key("network_interface", iface, f"the fabric interface of a node of {facts.probed_node}")
    elif facts.interfaces:
        lines.append(
            f"# network_interface: none set (a node has {', '.join(sorted(facts.interfaces))}: no fabric)"
        )
    way = "a new job" if facts.cred_expire_s >= NEW_JOB_FROM_S else "the same job"
    lines.append(
        f"# requeue_as: auto (the default): cred_expire is {facts.cred_expire_s} s, so a stopped job comes back "
        f"as {way}"
    )
    found = (["pyxis (srun --container-image)"] if facts.pyxis else []) + facts.runtimes
    lines.append(
        f"# containers: {', '.join(found)} found; pass --container-image per job or add a container: block"
        if found
        else "# containers: no runtime found on the nodes' PATH (nor pyxis)"
    )
    lines.extend(f"# not learned: {m}" for m in facts.missing)
    return "\n".join(lines) + "\n"
