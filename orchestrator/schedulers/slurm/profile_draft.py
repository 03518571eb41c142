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
from orchestrator.schedulers.slurm.discover import ClusterFacts, Node, Partition, fast_interface


@dataclass
class Answers:
    """What the cluster cannot say, from flags or prompts."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    setup: list[str] = field(default_factory=list)
    python: str | None = None
    gpu_type: str | None = None
    """``--gpu-type``: which of the partition's GPU types to draft (None: the one on most nodes)."""


@dataclass
class GpuKind:
    """One GPU type of a partition's nodes: its name as the cluster spells it (None: ``gpu:N``
    without a type), the nodes that have it in the cluster's order, and how many each has."""

    name: str | None
    nodes: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    @property
    def per_node(self) -> int:
        """What a job may ask of every node of this type (``gpus_per_node``): the smallest count."""
        return min(self.counts)

    def describe(self) -> str:
        low, high = min(self.counts), max(self.counts)
        each = f"{low} GPUs each" if low == high else f"{low} to {high} GPUs each"
        return f"{self.name or 'gpu without a type'} on {len(self.nodes)} node(s), {each}"


@dataclass
class GpuChoice:
    """The GPUs a draft asks for, and what else the partition has."""

    kind: GpuKind | None
    """None: a CPU profile (no GPUs, or some node without one and no ``--gpu-type``)."""
    kinds: list[GpuKind]
    without: int
    """The partition's nodes without a GPU."""
    how: str
    """Why ``kind``: ``--gpu-type``, or the type on most nodes."""


def gpu_kinds(nodes: list[Node]) -> list[GpuKind]:
    """Each GPU type of ``nodes``, in the order the cluster first lists it (a node's entries of one
    type add up)."""
    kinds: dict[str | None, GpuKind] = {}
    for node in nodes:
        mine: dict[str | None, int] = {}
        for name, count in node.gpu_kinds():
            mine[name] = mine.get(name, 0) + count
        for name, count in mine.items():
            kind = kinds.setdefault(name, GpuKind(name))
            kind.nodes.append(node.name)
            kind.counts.append(count)
    return list(kinds.values())


def choose_gpus(partition: str, nodes: list[Node], wanted: str | None) -> GpuChoice:
    """The GPU type to draft: ``wanted`` (``--gpu-type``, the cluster's spelling or any case), else
    the type on most of the partition's nodes (ties: the first the cluster lists). A partition where
    some node has no GPU stays a CPU profile unless ``wanted`` names a type."""
    kinds = gpu_kinds(nodes)
    without = sum(1 for n in nodes if not n.gpu_kinds())
    if wanted is not None:
        found = next((k for k in kinds if k.name == wanted), None) or next(
            (k for k in kinds if k.name and k.name.lower() == wanted.lower()), None
        )
        if found is None:
            has = (
                "its GPU types: " + "; ".join(k.describe() for k in kinds)
                if kinds
                else "no GPUs (no gpu GRES on its nodes)"
            )
            raise UserError(f"--gpu-type {wanted}: partition {partition} has no such GPU type; it has {has}")
        return GpuChoice(found, kinds, without, "--gpu-type")
    if not kinds or without:
        return GpuChoice(None, kinds, without, "")
    pick = max(kinds, key=lambda k: len(k.nodes))  # the first of the largest
    return GpuChoice(pick, kinds, without, "the type on most of the partition's nodes")


def _kinds_line(part: str, choice: GpuChoice) -> str:
    return f"GPU types of partition {part} (its nodes' GRES): " + "; ".join(
        k.describe() for k in choice.kinds
    )


def gpu_note(facts: ClusterFacts, answers: Answers) -> str | None:
    """One line for the user when the partition's GPUs left a choice (several types, or GPUs on only
    some nodes): what was drafted and how to pick another. None otherwise."""
    part = _choose_partition(facts, answers.partition)
    choice = choose_gpus(part.name, _partition_nodes(facts, part), answers.gpu_type)
    if not choice.kinds or (len(choice.kinds) == 1 and not choice.without):
        return None
    if choice.kind is None:
        return (
            f"{_kinds_line(part.name, choice)}; {choice.without} node(s) have none, so the draft is a CPU "
            "profile; --gpu-type TYPE drafts one for a type's nodes"
        )
    return f"{_kinds_line(part.name, choice)}; drafted {choice.kind.name or 'gpu'} ({choice.how})" + (
        "; --gpu-type TYPE picks another" if choice.how != "--gpu-type" else ""
    )


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


def _partition_nodes(facts: ClusterFacts, part: Partition) -> list[Node]:
    return [n for n in facts.nodes if n.name in part.nodes] or [
        n for n in facts.nodes if part.name in n.partitions
    ]


def draft(name: str, facts: ClusterFacts, answers: Answers, when: str | None = None) -> str:
    """The profile's YAML text."""
    part = _choose_partition(facts, answers.partition)
    nodes = _partition_nodes(facts, part)
    choice = choose_gpus(part.name, nodes, answers.gpu_type)
    count = len(part.nodes) or len(nodes)
    sized_by = ""
    if choice.kind is not None and len(choice.kind.nodes) < len(nodes):
        # Slurm places the job's --gres=gpu:TYPE:N on that type's nodes only: they size the profile.
        nodes = [n for n in nodes if n.name in choice.kind.nodes]
        count, sized_by = len(nodes), f" with {choice.kind.name or 'untyped'} GPUs"
    lines = [
        f"# Written by `orchestrator profiles init {name}` on {when or time.strftime('%Y-%m-%d %H:%M')} from what",
        "# the cluster said (scontrol, sacctmgr, srun); the comment on each key says where it came from.",
        "# Check it with `orchestrator profiles validate` and a small job before a long one.",
    ]

    def key(k: str, value: object, why: str) -> None:
        lines.append(f"{k}: {_yaml(value)}  # {why}")

    cpus = min((n.cpus for n in nodes if n.cpus), default=0)
    mem = min((n.memory_mb for n in nodes if n.memory_mb), default=0)
    gpu_count = choice.kind.per_node if choice.kind else 0
    gpu_type = choice.kind.name if choice.kind else None
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
        f"nodes: {{default: {min(2, most)}, max: {most}}}  # the partition's {count} node(s){sized_by}"
        + (f", MaxNodes {part.max_nodes}" if part.max_nodes else "")
    )
    if len(choice.kinds) > 1 or (choice.kinds and choice.without):
        lines.append(f"# {_kinds_line(part.name, choice)}")
    if choice.kind is not None and gpu_count:
        why = "the nodes' GRES"
        if len(choice.kinds) > 1 or choice.without:
            why = f"the {choice.kind.name or 'untyped'} nodes' GRES: {choice.how}"
            why += " (--gpu-type picks another)" if choice.how != "--gpu-type" else ""
        key("gpus_per_node", gpu_count, why)
        if gpu_type:
            # As the cluster spells it: the value goes into --gres, where Slurm matches the type.
            key("gpu_type", gpu_type, "the nodes' GRES type")
        key("exclusive", True, "whole GPU nodes for multi-GPU training")
    elif choice.kinds:
        lines.append(
            f"# gpus_per_node: none: {choice.without} of the partition's {len(nodes)} node(s) have no GPU; "
            "--gpu-type TYPE drafts a GPU profile for that type's nodes"
        )
    if cpus:
        key(
            "cpus_per_task",
            cpus,
            f"CPUs of the partition's smallest node{sized_by} (one task per node hosts every rank)",
        )
    if mem:
        key("mem", f"{mem}M", f"RealMemory of the partition's smallest node{sized_by}")
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
