"""The after-step decision of ``--auto-resume`` and the supervisor's reading of srun, without a cluster.

The cluster half (a node really dies; the new attempt excludes it and completes exactly) is
``tests/cluster/test_fault_tolerance.py::test_node_death_with_auto_resume_continues_without_that_node``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import load_profile
from orchestrator.schedulers.slurm import auto_resume as ar
from orchestrator.schedulers.slurm.batch_step import TASK_FAILURE_RE


@pytest.fixture()
def plan():
    name, _, profile = load_profile("slurm_test", None)
    return build_plan(
        name,
        profile,
        merge_options(profile, strategy="full_shard"),
        "train/train.py",
        nodes=2,
        auto_resume=True,
        max_requeues=2,
    )


def probes(**alive: bool) -> list[ar.ProbeResult]:
    return [ar.ProbeResult(node, ok, "ok" if ok else "no answer") for node, ok in alive.items()]


def test_lost_node_is_excluded_on_top_of_earlier_exclusions(plan) -> None:
    plan = replace(plan, exclude_nodes=("n9",))
    d = ar.decide("7", 1, probes(n1=True, n2=False), plan, 0, None)
    assert (d.action, d.lost_nodes, d.exclude_nodes) == ("resubmitted", ["n2"], ["n2", "n9"])


def test_every_node_answering_means_the_program_failed(plan) -> None:
    d = ar.decide("7", 1, probes(n1=True, n2=True), plan, 0, None)
    assert d.action == "none" and d.lost_nodes == [] and "every node still answers" in d.reason


def test_bound_on_resubmissions(plan) -> None:
    d = ar.decide("7", 1, probes(n1=True, n2=False), plan, 2, None)
    assert d.action == "refused" and "max_requeues" in d.reason and d.lost_nodes == ["n2"]


def test_cancelled_job_is_never_resubmitted(plan) -> None:
    d = ar.decide("7", 143, probes(n1=True, n2=False), plan, 0, "cancelled by user")
    assert d.action == "none" and d.reason == "cancelled by user"


def test_lost_node_without_auto_resume_says_how_to_resume(plan) -> None:
    d = ar.decide("7", 1, probes(n1=False, n2=True), plan, 0, None, auto_resume=False)
    assert d.action == "refused" and "orchestrator resume 7" in d.reason


def test_plan_round_trips_the_new_fields(plan) -> None:
    plan = replace(plan, exclude_nodes=("n2",))
    again = type(plan).from_json(json.loads(json.dumps(plan.to_json())))
    assert again.auto_resume is True and again.exclude_nodes == ("n2",)


def test_superseded_job_is_found_and_newest_plan_read(tmp_path: Path, plan) -> None:
    (tmp_path / "job.json").write_text(json.dumps(plan.to_json()))
    (tmp_path / "job.attempt_1.json").write_text(json.dumps(replace(plan, exclude_nodes=("n2",)).to_json()))
    assert ar.current_plan(tmp_path).exclude_nodes == ("n2",)
    assert ar.superseded_by(tmp_path, "7") is None
    ar.append_decision(
        tmp_path, ar.Decision("7", 1, "resubmitted", "node(s) n2 lost", ["n2"], new_job_id="8")
    )
    assert ar.superseded_by(tmp_path, "7") == "8" and ar.superseded_by(tmp_path, "8") is None


@pytest.mark.parametrize(
    "line,node",
    [
        (b"srun: error: n1: task 0: Exited with exit code 1\n", b"n1"),
        (b"srun: error: node-17: tasks 2-3: Killed\n", b"node-17"),
        (b"srun: error: gpu001: tasks 0,2: Segmentation fault\n", b"gpu001"),
    ],
)
def test_task_failure_lines_are_recognised(line: bytes, node: bytes) -> None:
    m = TASK_FAILURE_RE.search(line)
    assert m and m.group(1) == node


@pytest.mark.parametrize(
    "line",
    [
        b"srun: launch/slurm: _step_signal: Terminating StepId=9.0\n",
        b"srun: error: Node failure on n2\n",
        b"[default0]: srun: error: nothing\n",
    ],
)
def test_other_srun_lines_are_not_task_failures(line: bytes) -> None:
    assert not TASK_FAILURE_RE.search(line)


def test_requeue_as_auto_continues_as_a_new_job_where_the_credential_would_hold_it() -> None:
    from orchestrator.schedulers.slurm.auto_resume import requeue_mode

    assert requeue_mode("auto", cred_expire_s=120) == "new_job"  # Slurm's default: a 121 s hold
    assert requeue_mode("auto", cred_expire_s=10) == "same_job"  # the test cluster's
    assert requeue_mode("same_job", cred_expire_s=120) == "same_job"
    assert requeue_mode("new_job", cred_expire_s=10) == "new_job"


def test_a_node_lost_earlier_and_back_in_service_is_not_excluded_again(plan) -> None:
    """The chaos bench's second node death: n2 had died (a spare took its place) and was back in
    service (Slurm: idle) when n3 died with no spare left. The probe calls n2 lost too (it left the
    allocation); excluding it as well left 1 of the partition's 3 nodes, and the resubmission was
    refused. A node Slurm places jobs on again is not excluded; the new loss always is."""
    plan = replace(plan, exclude_nodes=("n9",))
    d = ar.decide(
        "7", 1, probes(n1=True, n2=False, n3=False), plan, 0, None, back_in_service=frozenset({"n2", "n9"})
    )
    assert d.action == "resubmitted"
    assert d.exclude_nodes == ["n3"]
    assert d.lost_nodes == ["n2", "n3"]
    assert "n2, n9 back in service (Slurm), not excluded" in d.reason


def test_without_slurms_word_every_lost_node_stays_excluded(plan) -> None:
    exclude, reason = ar.excluded(("n9",), ["n2", "n3"], frozenset())
    assert exclude == ["n2", "n3", "n9"] and reason == "node(s) n2, n3 lost"


def test_a_resubmission_asks_only_for_the_spares_the_partition_still_holds(plan) -> None:
    """A partition of nodes + spares (the chaos benchmark's 3 for 2 + 1): once a node is excluded, a
    new job asking for the spare too would wait for the dead node to come back."""
    from orchestrator.config.profile.records import ClusterProfile

    spared = replace(
        plan, profile=ClusterProfile.model_validate({**plan.profile.model_dump(), "spare_nodes": 1})
    )
    assert spared.profile.spare_nodes == 1 and spared.profile.partition == plan.profile.partition
    assert ar.spares_that_fit(spared, ["n1", "n2", "n3"]) == 1
    assert ar.spares_that_fit(replace(spared, exclude_nodes=("n3",)), ["n1", "n2", "n3"]) == 0
    assert ar.spares_that_fit(replace(spared, exclude_nodes=("n2", "n3")), ["n1", "n2", "n3"]) == 0
    assert ar.spares_that_fit(replace(spared, exclude_nodes=("n3",)), ["n1", "n2", "n3", "n4", "n5"]) == 1
