"""Start-up self-check: a silently single-process or silently unsharded run is impossible.

Each launch below reproduces one way Accelerate on CPU does the wrong thing without an
error (FIELD_NOTES); the training program must stop before its first step, with exit
code 3 and a message that says what was expected and what was found.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.rank import selfcheck
from tests.helpers import train_launch as tl
from tests.helpers.net import free_port

ORCHESTRATOR_EXPECTATIONS = (
    "ORCHESTRATOR_EXPECTED_WORLD_SIZE",
    "ORCHESTRATOR_EXPECTED_NUM_NODES",
    "ORCHESTRATOR_PROCS_PER_NODE",
    "ORCHESTRATOR_STRATEGY",
    "ORCHESTRATOR_FSDP_VERSION",
)


def _assert_selfcheck_failed(launch: tl.Launch, *needles: str, started: float) -> str:
    out = launch.output()
    assert launch.returncodes and all(code != 0 for code in launch.returncodes), out
    assert "SELF-CHECK FAILED (exit 3)" in out, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"
    assert tl.read_json(launch.run_dir / "exit_status.json")["code"] == 3
    assert not tl.read_metrics(launch.run_dir), "a training step ran"
    assert time.monotonic() - started < 90, "the self-check took too long"
    return out


def _multi_cpu_config(tmp_path, port: int):
    (config,) = tl.render_configs("ddp", 2, 1, 2, port, tmp_path / "cfg")
    text = config.read_text()
    assert "distributed_type: MULTI_GPU" in text
    config.write_text(text.replace("distributed_type: MULTI_GPU", "distributed_type: MULTI_CPU"))
    return config


@pytest.mark.slow
def test_multi_cpu_config_starts_one_process_and_is_refused(tmp_path):
    started = time.monotonic()
    config = _multi_cpu_config(tmp_path, free_port())
    launch = tl.start(
        tmp_path / "run", "ddp", 2, 1, 2, ["--max-steps", "3"], timeout=90, config_paths=[config]
    )
    try:
        launch.wait()
    finally:
        launch.kill()
    _assert_selfcheck_failed(launch, "expected world size 2, found 1", "MULTI_CPU config", started=started)


@pytest.mark.slow
def test_multi_cpu_config_is_refused_when_run_by_hand(tmp_path):
    """No ORCHESTRATOR_* variables: the expectation comes from the parent `accelerate launch` config."""
    started = time.monotonic()
    config = _multi_cpu_config(tmp_path, free_port())
    env = dict.fromkeys(ORCHESTRATOR_EXPECTATIONS)
    launch = tl.start(
        tmp_path / "run", "ddp", 2, 1, 2, ["--max-steps", "3"], timeout=90, env=env, config_paths=[config]
    )
    try:
        launch.wait()
    finally:
        launch.kill()
    _assert_selfcheck_failed(
        launch,
        "expected world size 2, found 1",
        "parent `accelerate launch`",
        "start ONE process",
        started=started,
    )


@pytest.mark.slow
def test_fsdp_on_cpu_without_the_shim_is_detected(tmp_path):
    started = time.monotonic()
    launch = tl.run(
        tmp_path / "run",
        "full_shard",
        2,
        1,
        2,
        ["--max-steps", "3"],
        timeout=90,
        env={"ORCHESTRATOR_DISABLE_WORKAROUNDS": "fsdp_on_cpu"},
    )
    _assert_selfcheck_failed(
        launch,
        "expected FSDP (full_shard), found distributed type MULTI_CPU",
        "silently drops FSDP on CPU",
        started=started,
    )


@pytest.mark.slow
def test_fsdp1_hybrid_without_device_mesh_is_detected(tmp_path):
    """torch sizes FSDP1 hybrid shard groups by torch.cpu.device_count() == 1 without an explicit mesh."""
    started = time.monotonic()
    launch = tl.run(
        tmp_path / "run",
        "hybrid_shard",
        1,
        2,
        2,
        ["--max-steps", "3"],
        timeout=120,
        env={"ORCHESTRATOR_DISABLE_WORKAROUNDS": "fsdp1_hybrid_mesh"},
    )
    out = _assert_selfcheck_failed(launch, "expected FSDP1", started=started)
    assert "shard groups of 2 rank(s), found 1" in out or "found NO_SHARD" in out, out


@pytest.mark.slow
def test_gpu_config_without_accelerate_use_cpu_is_detected(tmp_path):
    """A MULTI_GPU config on a CPU machine without ACCELERATE_USE_CPU=1: N processes, each training alone."""
    started = time.monotonic()
    launch = tl.run(
        tmp_path / "run", "ddp", 2, 1, 2, ["--max-steps", "3"], timeout=90, env={"ACCELERATE_USE_CPU": None}
    )
    out = _assert_selfcheck_failed(
        launch, "expected world size 2, found 1", "ACCELERATE_USE_CPU=1", started=started
    )
    # this machine's torch is a CPU-only build: the hint names it and what a GPU profile needs
    assert "(a CPU-only build)" in out and "sees no CUDA device" in out and "gpus_per_node: 0" in out, out


# ---------------------------------------------------------------------------
# Expectations, without launching anything


def test_expectations_from_the_launcher():
    exp = selfcheck.expectations_from_env(
        {
            "ORCHESTRATOR_EXPECTED_WORLD_SIZE": "4",
            "ORCHESTRATOR_EXPECTED_NUM_NODES": "2",
            "ORCHESTRATOR_PROCS_PER_NODE": "2",
            "ORCHESTRATOR_STRATEGY": "hybrid_shard",
            "ORCHESTRATOR_FSDP_VERSION": "1",
            "WORLD_SIZE": "1",
        }
    )
    assert (exp.world_size, exp.num_nodes, exp.procs_per_node, exp.strategy, exp.fsdp_version) == (
        4,
        2,
        2,
        "hybrid_shard",
        1,
    )
    assert "launcher" in exp.source
    assert selfcheck.expected_groups(exp, 4) == (2, 2)


@pytest.mark.parametrize(
    "env,strategy,version",
    [
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"},
            "hybrid_shard",
            1,
        ),
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "2"},
            "shard_grad_op",
            1,
        ),
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"},
            "shard_grad_op",
            2,
        ),
        (
            {
                "ACCELERATE_USE_FSDP": "true",
                "FSDP_VERSION": "2",
                "FSDP_RESHARD_AFTER_FORWARD": "true",
                "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            },
            "hybrid_shard",
            2,
        ),
        ({}, "ddp", None),
    ],
)
def test_expectations_by_hand_from_the_accelerate_environment(env, strategy, version):
    exp = selfcheck.expectations_from_env(
        {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", **env}, look_at_parent=False
    )
    assert (exp.world_size, exp.num_nodes, exp.procs_per_node) == (4, 2, 2)
    assert (exp.strategy, exp.fsdp_version) == (strategy, version)


def test_unknown_strategy_in_the_environment_is_an_error():
    with pytest.raises(selfcheck.SelfCheckError, match="ORCHESTRATOR_STRATEGY"):
        selfcheck.expectations_from_env({"ORCHESTRATOR_STRATEGY": "zero3"})
