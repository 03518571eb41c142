"""Plans with a ``container:`` block for the tests of :mod:`orchestrator.config.container`: a valid
block per runtime, and a plan that holds a block's values as they are, past every profile check."""

from __future__ import annotations

from typing import Any

import yaml

from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.profile.records import ClusterProfile, Container
from tests.helpers.cli import REPO

SCRIPT = str(REPO / "train" / "train.py")
#: The test cluster's profile, which each test gives a ``container:`` block.
BASE = yaml.safe_load((REPO / "cluster_profiles" / "slurm_test.yaml").read_text())
#: A valid image per runtime.
GOOD_IMAGE = {
    "pyxis": "nvcr.io#nvidia/pytorch:25.01-py3",
    "apptainer": "/img/t.sif",
    "podman": "img:1",
    "oci": "/img/rootfs",
}


def plan_with(runtime: str, **values: Any) -> LaunchPlan:
    """A plan whose container holds ``values`` as they are, past every profile check (a record made
    by hand, a plan read back): what the render's own guards and the runtime are left with."""
    block = {"runtime": runtime, "image": GOOD_IMAGE[runtime]}
    profile = parse_profile(yaml.safe_dump({**BASE, "container": block}), "c.yaml")
    fields = {name: getattr(profile.container, name) for name in Container.model_fields}
    bad = Container._make({**fields, **values})
    profile = ClusterProfile._make(
        {**{name: getattr(profile, name) for name in ClusterProfile.model_fields}, "container": bad}
    )
    options = merge_options(profile, strategy="full_shard")
    return build_plan("t", profile, options, SCRIPT, nodes=2, procs_per_node=1)
