"""Spare nodes (a profile's ``spare_nodes``): which nodes train, which wait, who replaces whom, and
the sbatch script that holds them. The cluster's side (a node killed, the spare takes over):
tests/cluster/test_restart_in_allocation.py."""

from __future__ import annotations

import sys

import pytest
import yaml

from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.render import render_sbatch
from orchestrator.contract.errors import UserError
from orchestrator.schedulers.slurm.spares import Placement, placement_of
from tests.helpers.cli import REPO

TRAIN = str(REPO / "train" / "train.py")


def _profile(name: str, **keys: object) -> object:
    data = yaml.safe_load((REPO / "cluster_profiles" / f"{name}.yaml").read_text())
    return parse_profile(yaml.safe_dump({**data, **keys}), f"/p/{name}.yaml")


def test_the_step_trains_on_the_first_nodes_and_a_lost_one_is_replaced_by_a_spare() -> None:
    placement = placement_of(["n1", "n2", "n3", "n4"], nodes=2, spare_nodes=2)
    assert (
        placement is not None and placement.training() == ["n1", "n2"] and placement.spares() == ["n3", "n4"]
    )
    argv = placement.step_argv(["srun", "--unbuffered", "python", "-m", "x"])
    assert argv == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--nodelist=n1,n2",
        "--unbuffered",
        "python",
        "-m",
        "x",
    ]
    assert placement.replace(["n2"]) == ["n3"]
    assert placement.training() == ["n1", "n3"] and placement.spares() == ["n4"]
    assert placement.step_argv(["srun", "x"]) == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--nodelist=n1,n3",
        "--overlap",
        "x",
    ]
    assert placement.replace(["n3"]) == ["n4"] and placement.training() == ["n1", "n4"]
    # No spare left: nothing changes, the caller ends the step (auto-resume's path).
    assert placement.replace(["n4"]) is None and placement.training() == ["n1", "n4"]


def test_the_batch_host_is_never_left_out_and_unknown_nodes_change_nothing() -> None:
    placement = Placement(["n1", "n2", "n3"], 2)
    assert placement.replace(["n1"]) is None and placement.training() == ["n1", "n2"]
    assert placement.replace(["n9"]) is None and placement.left_out == []


def test_without_spares_the_step_runs_on_the_whole_allocation() -> None:
    assert placement_of(["n1", "n2"], nodes=2, spare_nodes=0) is None
    assert placement_of(["n1", "n2"], nodes=2, spare_nodes=1) is None  # the allocation has none to spare


def test_the_sbatch_script_holds_the_spares_and_survives_a_node_failure(tmp_path: object) -> None:
    profile = _profile("slurm_test", spare_nodes=1)
    plan = build_plan("slurm_test", profile, merge_options(profile), TRAIN, nodes=2, procs_per_node=1)  # type: ignore[arg-type]
    sbatch = render_sbatch(plan, "/runs/r", "/runs/r/submitit", sys.executable)
    assert "#SBATCH --nodes=3\n" in sbatch and "#SBATCH --no-kill\n" in sbatch
    plain = _profile("slurm_test")
    plan = build_plan("slurm_test", plain, merge_options(plain), TRAIN, nodes=2, procs_per_node=1)  # type: ignore[arg-type]
    sbatch = render_sbatch(plan, "/runs/r", "/runs/r/submitit", sys.executable)
    assert "#SBATCH --nodes=2\n" in sbatch and "--no-kill" not in sbatch


def test_spare_nodes_are_refused_on_local_and_out_of_range() -> None:
    profile = _profile("local", spare_nodes=1)
    with pytest.raises(UserError, match="spare_nodes: profile 'local' runs locally"):
        build_plan("local", profile, merge_options(profile), TRAIN, nodes=1, procs_per_node=1)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="spare_nodes"):
        _profile("slurm_test", spare_nodes=-1)


def test_with_no_spare_left_a_shrinking_job_goes_on_with_the_nodes_left() -> None:
    placement = placement_of(["n1", "n2", "n3"], nodes=3, spare_nodes=0, shrink=True, procs_per_node=2)
    assert placement is not None and placement.step_env() == {}
    assert placement.replace(["n3"]) is None  # no spare
    assert placement.shrink(["n3"]) == 2 and placement.training() == ["n1", "n2"]
    assert placement.step_env() == {"ORCHESTRATOR_STEP_NODES": "2", "ORCHESTRATOR_BATCH_WORLD_SIZE": "6"}
    assert placement.step_argv(["srun", "x"])[1:5] == [
        "--nodes=2",
        "--ntasks=2",
        "--nodelist=n1,n2",
        "--overlap",
    ]
    assert placement.shrink(["n1"]) is None  # the batch host


def test_shrinking_is_refused_where_the_global_batch_or_the_checkpoint_cannot_follow() -> None:
    from orchestrator.schedulers.slurm.spares import shrink_refusal

    profile = _profile("slurm_test", on_node_loss="shrink")
    plan = build_plan("slurm_test", profile, merge_options(profile), TRAIN, nodes=3, procs_per_node=1)  # type: ignore[arg-type]
    assert shrink_refusal(plan, 1) is None
    assert "does not divide 3" in (shrink_refusal(plan, 2) or "")
    zero = merge_options(profile, strategy="deepspeed_zero2")  # type: ignore[arg-type]
    plan = build_plan("slurm_test", profile, zero, TRAIN, nodes=2, procs_per_node=1)  # type: ignore[arg-type]
    assert "does not reshard" in (shrink_refusal(plan, 1) or "")
    with pytest.raises(UserError, match="on_node_loss: shrink: profile 'local'"):
        local = _profile("local", on_node_loss="shrink")
        build_plan("local", local, merge_options(local), TRAIN, nodes=1, procs_per_node=1)  # type: ignore[arg-type]
