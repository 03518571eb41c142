"""A LaunchPlan from a job's request (``config/job_request.py``): the one planning path of
``orchestrator.make_plan`` and of the command line's flags (``render``, ``submit``, ``sweep``).

A value left None was not given: the profile's default applies, and a refusal of it names the
profile's file and key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config.container import with_container_image
from orchestrator.config.job_request import JobRequest, default_profile
from orchestrator.config.options import OPTIONS
from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import display_path, load_profile
from orchestrator.config.scheduler_kinds import scheduler_kind
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; read by the type checker only

    from orchestrator.config.gpus import GpuCount
    from orchestrator.config.job_request import PlanKeywords
    from orchestrator.config.profile.load import ClusterProfile


def plan_request(request: JobRequest) -> LaunchPlan:
    """The checked plan of ``request``. Every keyword is checked first (:meth:`JobRequest.checked`:
    the API's and the CLI's one check); then the profile is loaded (with the request's container
    image), the options merged over its defaults, and :func:`build_plan` given the rest."""
    checked = request.checked()
    profile_name, path, cluster = load_profile(checked.profile or default_profile(), checked.profiles_dir)
    if checked.container_image is not None:
        cluster = with_container_image(cluster, checked.container_image, display_path(path))
    if cluster.gpus_per_node and scheduler_kind(cluster.scheduler).gpus_of_this_machine:
        cluster = fit_to_this_machine(profile_name, cluster, checked.nodes, checked.procs_per_node)
    given = checked.given_options()
    merged = merge_options(cluster, **given)
    try:
        return build_plan(profile_name, cluster, merged, **checked.plan_inputs())
    except UserError as exc:
        typed = {**given, "nodes": checked.nodes, "procs_per_node": checked.procs_per_node}
        raise UserError(blame_profile(str(exc), typed, display_path(path))) from None


def plan_from_options(**keywords: Unpack[PlanKeywords]) -> LaunchPlan:
    """:func:`plan_request` of ``make_plan``'s keywords."""
    return plan_request(JobRequest.from_keywords(keywords, "plan_from_options"))


def fit_to_this_machine(
    profile_name: str,
    cluster: ClusterProfile,
    nodes: int | None,
    procs_per_node: int | None,
    found: GpuCount | None = None,
) -> ClusterProfile:
    """A GPU profile whose nodes are this machine (``local_gpu``): its ``gpus_per_node`` is the most
    a node may use; the plan gets what this machine has (shared by its simulated nodes), so the
    default is one rank per GPU found. Asking for more GPUs than there are is refused here, naming
    the count and how it was found, instead of failing in NCCL at the first collective."""
    from orchestrator.config.gpus import count_gpus

    found = found or count_gpus()
    node_count = cluster.nodes.default if nodes is None else nodes
    if found.count == 0:
        raise UserError(
            f"--profile {profile_name}: trains on this machine's GPUs (gpus_per_node: {cluster.gpus_per_node}), "
            f"but none were found ({found.source}); use --profile local to train on CPU"
        )
    wanted = procs_per_node if procs_per_node is not None else cluster.procs_per_node
    if wanted is not None and node_count >= 1 and wanted * node_count > found.count:
        raise UserError(
            f"--procs-per-node: {node_count} node(s) x {wanted} process(es) need {wanted * node_count} GPUs "
            f"(one process per GPU), but this machine has {found.count} ({found.source})"
        )
    per_node = min(cluster.gpus_per_node, found.count // max(node_count, 1))
    if node_count >= 1 and per_node == 0:
        raise UserError(
            f"--nodes: {node_count} simulated nodes need at least one GPU each, but this machine has "
            f"{found.count} ({found.source})"
        )
    if per_node == cluster.gpus_per_node:
        return cluster
    return type(cluster)._make({**cluster.__dict__, "gpus_per_node": per_node})


#: flag -> (option or keyword name, the profile key that supplies it when the flag is not given)
_PROFILE_KEYS = {
    **{o.flag: (o.name, o.profile_key) for o in OPTIONS},
    "--nodes": ("nodes", "nodes.default"),
    "--procs-per-node": ("procs_per_node", "procs_per_node"),
}


def blame_profile(message: str, given: Mapping[str, Any], source: str) -> str:
    """A refused value the user did not give came from the profile: say which file and key.
    ``given``: the values given, by name (None or absent: not given)."""
    flag = message.split(":", 1)[0].split(" ", 1)[0]
    entry = _PROFILE_KEYS.get(flag)
    if entry is None or given.get(entry[0]) is not None:
        return message
    return f"{message} ({flag} not given; set by {source}: {entry[1]})"


def check_profile_defaults(name: str, path: Path, profile: ClusterProfile) -> None:
    """The checks ``render --profile NAME`` runs with no flags: the plan its defaults make (strategy
    combination, bf16 on pre-Ampere GPUs, fp16 without GPUs, node and process counts). A profile that
    parses but that every ``render`` would refuse is not valid."""
    try:
        build_plan(name, profile, merge_options(profile), script="SCRIPT")
    except UserError as exc:
        raise UserError(blame_profile(str(exc), {}, display_path(path))) from None
