"""Every strategy computes the same training run (FIELD_NOTES: the correctness oracle).

Each batch is a pure function of (seed, sample index), so at one world size every
correct strategy (DDP, FSDP1 any sharding, FSDP2, HSDP) gives the same losses to
4 decimals; one that does not synchronise gradients diverges at once. Runs go
through the orchestrator's rendered Accelerate configs (tests/helpers/train_launch.py).
"""

from __future__ import annotations

import math

import pytest

from tests.helpers import train_launch as tl
from tests.helpers.net import free_port

STEPS = 20
ARGS = ("--max-steps", str(STEPS))

TRAIN_KEYS = {
    "event": str, "step": int, "max_steps": int, "loss": float, "lr": float, "grad_norm": float,
    "tokens_per_s": float, "step_time_s": float, "peak_mem_mb": float, "world_size": int, "strategy": str,
    "time": float,
}  # fmt: skip

pytestmark = pytest.mark.slow


def _assert_same_losses(reference: tl.Launch, other: tl.Launch, what: str) -> None:
    ref, got = tl.losses(reference.run_dir), tl.losses(other.run_dir)
    assert sorted(ref) == list(range(1, STEPS + 1)), reference.output()
    assert sorted(got) == list(range(1, STEPS + 1)), other.output()
    diffs = {s: (ref[s], got[s]) for s in ref if abs(ref[s] - got[s]) >= 1e-4}
    assert not diffs, f"{what}: losses differ from the reference at steps {diffs}"


def _assert_replicas_agree(launch: tl.Launch, world: int, shard_group: int) -> None:
    """Ranks that hold the same shard in different replicas hold the same values after training."""
    sums = {}
    for rank in range(world):
        sums[rank] = tl.read_json(launch.run_dir / "replicas" / f"rank{rank}.json")["local_param_checksum"]
    for rank in range(world):
        twin = rank % shard_group
        assert sums[rank] == sums[twin], f"rank {rank} and rank {twin} hold the same shard but differ: {sums}"


def test_ddp_reference_run_and_metrics_schema():
    launch = tl.cached_run("ddp", 2, 1, 2, ARGS)
    tl.assert_ok(launch)
    records = tl.read_metrics(launch.run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert set(record) == set(TRAIN_KEYS), record
        for key, kind in TRAIN_KEYS.items():
            assert isinstance(record[key], kind), (key, record)
        assert record["world_size"] == 2 and record["strategy"] == "ddp" and record["max_steps"] == STEPS
    evals = tl.read_metrics(launch.run_dir, "eval")
    assert evals and set(evals[-1]) == {"event", "step", "val_loss", "time"} and evals[-1]["step"] == STEPS
    losses = tl.losses(launch.run_dir)
    assert math.isclose(losses[1], math.log(256), abs_tol=0.3), losses[1]  # starts near uniform over bytes
    assert losses[STEPS] < losses[1] - 0.3, "the model does not learn"
    final = tl.read_json(launch.run_dir / "final.json")
    assert final["step"] == STEPS and final["world_size"] == 2 and final["param_checksum"] is not None
    marker = tl.read_json(launch.run_dir / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE.json")
    assert marker["param_checksum"] == final["param_checksum"]
    assert list((launch.run_dir / "tensorboard").rglob("events.out.tfevents.*")), "no TensorBoard events"
    _assert_replicas_agree(launch, 2, 1)


# Size-based wrapping (the default, 1e6 parameters) leaves the tiny model one FSDP unit; with FSDP2
# Accelerate then shards only the root (torch's default resharding) and a norm/head "tail" (never
# resharded), so full_shard and shard_grad_op would run identically. Wrapping TransformerBlock makes
# the difference real (and the self-check verifies reshard_after_forward on those units).
BLOCK = "TransformerBlock"


@pytest.mark.parametrize(
    "strategy,fsdp_version,wrap_cls",
    [
        ("full_shard", 1, None),
        ("full_shard", 2, None),
        ("shard_grad_op", 1, None),
        ("shard_grad_op", 2, BLOCK),
        ("no_shard", 1, None),
    ],
)
def test_two_ranks_match_ddp(strategy, fsdp_version, wrap_cls):
    reference = tl.cached_run("ddp", 2, 1, 2, ARGS)
    tl.assert_ok(reference)
    launch = tl.cached_run(strategy, fsdp_version, 1, 2, ARGS, wrap_cls=wrap_cls)
    tl.assert_ok(launch)
    _assert_same_losses(reference, launch, f"{strategy} FSDP{fsdp_version}")
    assert tl.read_metrics(launch.run_dir)[-1]["strategy"] == strategy
    ref_final = tl.read_json(reference.run_dir / "final.json")
    final = tl.read_json(launch.run_dir / "final.json")
    assert math.isclose(final["param_checksum"], ref_final["param_checksum"], rel_tol=1e-6)
    assert math.isclose(final["optim_checksum"], ref_final["optim_checksum"], rel_tol=1e-5)
    # Sharded strategies hold different shards on the two ranks; NO_SHARD replicates everything.
    if strategy == "no_shard":
        _assert_replicas_agree(launch, 2, 1)
    assert "self-check ok" in launch.output()
    if wrap_cls and fsdp_version == 2:
        want = "reshard_after_forward=" + ("False" if strategy == "shard_grad_op" else "True")
        assert want in launch.output()


@pytest.mark.parametrize(
    "strategy,fsdp_version,wrap_cls",
    [
        ("hybrid_shard", 1, None),
        ("hybrid_shard", 2, None),
        ("hybrid_shard_zero2", 1, BLOCK),
        ("hybrid_shard_zero2", 2, BLOCK),
    ],
)
def test_two_nodes_hybrid_match_four_rank_ddp(strategy, fsdp_version, wrap_cls):
    reference = tl.cached_run("ddp", 2, 2, 2, ARGS)
    tl.assert_ok(reference)
    launch = tl.cached_run(strategy, fsdp_version, 2, 2, ARGS, wrap_cls=wrap_cls)
    tl.assert_ok(launch)
    _assert_same_losses(reference, launch, f"{strategy} FSDP{fsdp_version} 2x2")
    ref_final = tl.read_json(reference.run_dir / "final.json")
    final = tl.read_json(launch.run_dir / "final.json")
    assert math.isclose(final["param_checksum"], ref_final["param_checksum"], rel_tol=1e-6)
    # Replicate x shard: rank r holds shard r % 2; node 1's copy must equal node 0's.
    _assert_replicas_agree(launch, 4, 2)
    _assert_replicas_agree(reference, 4, 1)


def _size_based_configs(folder, min_num_params: int) -> list:
    """full_shard FSDP2 configs with size-based wrapping at a threshold the tiny model's ModuleList of
    blocks (~266k parameters) exceeds, as the ``small`` and ``base`` presets do at the default 1e6."""
    configs = tl.render_configs("full_shard", 2, 1, 2, free_port(), folder)
    text = configs[0].read_text()
    assert "fsdp_auto_wrap_policy: SIZE_BASED_WRAP" in text and "fsdp_min_num_params: 1000000" in text, text
    configs[0].write_text(
        text.replace("fsdp_min_num_params: 1000000", f"fsdp_min_num_params: {min_num_params}")
    )
    return configs


def test_fsdp2_size_based_wrap_skips_the_blocks_module_list(tmp_path):
    """Workaround ``fsdp2_size_based_wrap``: FSDP1's rule (containers never wrapped, only parameters not yet
    in a wrapped child count), so the MLPs (~132k parameters each) become units and the run equals DDP."""
    reference = tl.cached_run("ddp", 2, 1, 2, ARGS)
    tl.assert_ok(reference)
    configs = _size_based_configs(tmp_path / "configs", 100_000)
    launch = tl.start(tmp_path / "run", "full_shard", 2, 1, 2, list(ARGS), config_paths=configs)
    try:
        launch.wait()
    finally:
        launch.kill()
    tl.assert_ok(launch)
    out = launch.output()
    assert "fsdp2_size_based_wrap" in out and "units GPT, MLP x4" in out, out
    _assert_same_losses(reference, launch, "full_shard FSDP2 size-based wrap")


def test_fsdp2_size_based_wrap_without_the_workaround_fails(tmp_path):
    """The workaround is still needed: Accelerate's own policy wraps the ModuleList and fully_shard refuses.
    When this starts passing a training run, Accelerate is fixed and the workaround can go."""
    configs = _size_based_configs(tmp_path / "configs", 100_000)
    launch = tl.start(
        tmp_path / "run", "full_shard", 2, 1, 2, ["--max-steps", "2"], config_paths=configs,
        env={"ORCHESTRATOR_DISABLE_WORKAROUNDS": "fsdp2_size_based_wrap"},
    )  # fmt: skip
    try:
        codes = launch.wait()
    finally:
        launch.kill()
    assert any(code != 0 for code in codes)
    assert "fully_shard does not support containers that do not implement forward" in launch.output()
