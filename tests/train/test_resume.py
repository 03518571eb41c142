"""Checkpoint/resume: exact after SIGKILL, across world sizes, never from a torn checkpoint; requeue on signal.

The interrupted runs are killed (the whole process tree, SIGKILL) as soon as the
step-10 checkpoint's marker exists, then relaunched; the uninterrupted 20-step
baselines are shared with tests/train/test_equivalence.py (tests/helpers/train_launch.py caches runs).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from orchestrator.contract import checkpoints
from tests.helpers import train_launch as tl
from tests.helpers.run_dirs import marker_path

STEPS = 20
ARGS = ("--max-steps", str(STEPS))
KILL_AT = 10


_INTERRUPTED: dict[tuple, Path] = {}


def interrupted_and_resumed(strategy: str, fsdp_version: int, nodes: int, procs: int) -> Path:
    """Run to the step-10 checkpoint, SIGKILL everything, resume to step 20 (cached per configuration)."""
    key = (strategy, fsdp_version, nodes, procs)
    if key not in _INTERRUPTED:
        run_dir = tl.cached_runs_dir() / f"resume-{strategy}-v{fsdp_version}-{nodes}x{procs}"
        first = tl.start(run_dir, strategy, fsdp_version, nodes, procs, [*ARGS, "--ckpt-every", str(KILL_AT)])
        try:
            first.poll_until(
                lambda: marker_path(run_dir, KILL_AT).exists(), 150, f"the step-{KILL_AT} checkpoint"
            )
        finally:
            first.kill(signal.SIGKILL)
        assert not marker_path(run_dir, STEPS).exists()
        second = tl.start(run_dir, strategy, fsdp_version, nodes, procs, list(ARGS))
        try:
            second.wait()
        finally:
            second.kill()
        tl.assert_ok(second)
        _INTERRUPTED[key] = run_dir
    return _INTERRUPTED[key]


def _assert_resume_exact(baseline: tl.Launch, run_dir: Path) -> None:
    tl.assert_ok(baseline)
    ref, got = tl.losses(baseline.run_dir), tl.losses(run_dir)
    tail = list(range(KILL_AT + 1, STEPS + 1))
    # Bit-equal: same floats, not merely close.
    assert [got[s] for s in tail] == [ref[s] for s in tail], {s: (ref[s], got[s]) for s in tail}
    resumes = tl.read_metrics(run_dir, "resume")
    assert (
        resumes
        and resumes[-1]["step"] == KILL_AT
        and resumes[-1]["checkpoint"].endswith(f"step_{KILL_AT:08d}")
    )
    loaded = tl.read_json(run_dir / "loaded.json")
    saved = tl.read_json(marker_path(run_dir, KILL_AT))
    assert loaded["param_checksum"] == saved["param_checksum"]
    assert loaded["optim_checksum"] == saved["optim_checksum"]
    final, ref_final = tl.read_json(run_dir / "final.json"), tl.read_json(baseline.run_dir / "final.json")
    assert final["param_checksum"] == ref_final["param_checksum"]
    assert final["optim_checksum"] == ref_final["optim_checksum"]
    assert final["loss"] == ref_final["loss"]


RESUME_CASES = [
    pytest.param("ddp", 2, 1, 2, id="ddp"),
    pytest.param("full_shard", 1, 1, 2, id="full_shard-fsdp1"),
    pytest.param("full_shard", 2, 1, 2, id="full_shard-fsdp2"),
    pytest.param("hybrid_shard", 2, 2, 2, id="hybrid_shard-fsdp2-2x2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,fsdp_version,nodes,procs", RESUME_CASES)
def test_sigkill_then_resume_is_bit_exact(strategy, fsdp_version, nodes, procs):
    baseline = tl.cached_run(strategy, fsdp_version, nodes, procs, ARGS)
    run_dir = interrupted_and_resumed(strategy, fsdp_version, nodes, procs)
    _assert_resume_exact(baseline, run_dir)


@pytest.mark.slow
def test_resharded_resume_four_to_two_skips_torn_checkpoints(tmp_path):
    """A 4-rank HSDP checkpoint loads at 2 ranks (FSDP2 full_shard) with exact checksums; newer torn
    checkpoints (no marker, a truncated shard, an unfinished temp folder) are skipped."""
    source = interrupted_and_resumed("hybrid_shard", 2, 2, 2)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    good = ckpts / f"step_{KILL_AT:08d}"
    shutil.copytree(source / "checkpoints" / good.name, good)
    no_marker = ckpts / "step_00000013"
    shutil.copytree(good, no_marker)
    (no_marker / "COMPLETE.json").unlink()
    truncated = ckpts / "step_00000012"
    shutil.copytree(good, truncated)
    shard = truncated / "pytorch_model_fsdp_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    shutil.copytree(good, ckpts / ".tmp-step_00000014-deadbeef")
    (ckpts / ".tmp-step_00000014-deadbeef" / "COMPLETE.json").unlink()

    launch = tl.run(run_dir, "full_shard", 2, 1, 2, ["--max-steps", str(KILL_AT + 2)])
    tl.assert_ok(launch)
    out = launch.output()
    loaded = tl.read_json(run_dir / "loaded.json")
    saved = tl.read_json(good / "COMPLETE.json")
    assert saved["world_size"] == 4 and loaded["world_size"] == 2
    assert loaded["step"] == KILL_AT and loaded["checkpoint"].endswith(good.name)
    assert loaded["param_checksum"] == saved["param_checksum"]
    assert loaded["optim_checksum"] == saved["optim_checksum"]
    assert "skipping checkpoint" in out and "step_00000013" in out and "step_00000012" in out
    assert "truncated" in out
    assert "resharding: checkpoint from world size 4, now 2" in out and "RNG states of ranks 2..3" in out
    assert sorted(tl.losses(run_dir)) == [KILL_AT + 1, KILL_AT + 2]


@pytest.mark.slow
def test_fsdp1_optimizer_state_is_verified_on_load(tmp_path):
    """Without the FSDP1 optimizer-init workaround Accelerate drops the optimizer state on load:
    the checksum comparison catches it (exit 4), it never trains on silently."""
    source = interrupted_and_resumed("full_shard", 1, 1, 2)
    run_dir = tmp_path / "run"
    shutil.copytree(
        source / "checkpoints" / f"step_{KILL_AT:08d}", run_dir / "checkpoints" / f"step_{KILL_AT:08d}"
    )
    launch = tl.run(
        run_dir,
        "full_shard",
        1,
        1,
        2,
        list(ARGS),
        env={"ORCHESTRATOR_DISABLE_WORKAROUNDS": "fsdp1_optimizer_state_on_load"},
    )
    assert launch.returncodes != [0]
    out = launch.output()
    assert "restored state does not match the checkpoint" in out and "optim_checksum" in out, out
    assert "exitcode  : 4" in out
    assert tl.read_json(run_dir / "exit_status.json")["code"] == 4
    assert not tl.read_metrics(run_dir), "trained on after a bad restore"


@pytest.mark.slow
def test_sigusr2_checkpoints_exits_75_and_resume_loses_no_step(tmp_path):
    baseline = tl.cached_run("ddp", 2, 1, 2, ARGS)
    tl.assert_ok(baseline)
    run_dir = tmp_path / "run"
    launch = tl.start(run_dir, "ddp", 2, 1, 2, list(ARGS))
    try:
        launch.poll_until(lambda: max(tl.losses(run_dir), default=0) >= 5, 120, "step 5")
        workers = launch.workers()
        assert len(workers) == 2, [w.cmdline() for w in workers]
        # One rank only: the ranks must agree to stop together (all_reduce MAX of the flag).
        max(workers, key=lambda w: w.pid).send_signal(signal.SIGUSR2)
        launch.wait(timeout=90)
    finally:
        launch.kill()
    out = launch.output()
    status = tl.read_json(run_dir / "exit_status.json")
    assert status["code"] == 75 and status["reason"] == "signal", out
    stopped = status["step"]
    assert 5 <= stopped < STEPS
    assert f"requeue: checkpoint step {stopped} saved" in out
    assert out.count("exitcode  : 75") == 2, out  # both workers exit EX_TEMPFAIL (torchrun itself exits 1)
    assert marker_path(run_dir, stopped).exists()
    assert max(tl.losses(run_dir)) == stopped, "a step ran after the stop was agreed"

    resumed = tl.run(run_dir, "ddp", 2, 1, 2, list(ARGS))
    tl.assert_ok(resumed)
    ref, got = tl.losses(baseline.run_dir), tl.losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), "a step was lost or repeated"
    assert [got[s] for s in range(1, STEPS + 1)] == [ref[s] for s in range(1, STEPS + 1)]
    assert tl.read_metrics(run_dir, "resume")[-1]["step"] == stopped


# ---------------------------------------------------------------------------
# Marker protocol, without launching anything


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    tmp = root / "checkpoints" / f".tmp-step_{step:08d}-abc"
    (tmp / "optimizer_0").mkdir(parents=True)
    (tmp / "optimizer_0" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp / "random_states_0.pkl").write_bytes(b"y" * 10)
    if not complete:
        return tmp
    final = root / "checkpoints" / f"step_{step:08d}"
    checkpoints.finalize(tmp, final, {"step": step, "world_size": 1, "strategy": "ddp", "fsdp_version": None})
    return final


def test_marker_lists_files_and_sizes(tmp_path):
    folder = _fake_checkpoint(tmp_path, 3)
    marker = json.loads((folder / "COMPLETE.json").read_text())
    assert marker["files"] == {"optimizer_0/__0_0.distcp": 100, "random_states_0.pkl": 10}
    assert (
        marker["step"] == 3
        and marker["world_size"] == 1
        and marker["strategy"] == "ddp"
        and "fsdp_version" in marker
    )
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_resume_picks_newest_complete_and_skips_torn(tmp_path):
    _fake_checkpoint(tmp_path, 5)
    _fake_checkpoint(tmp_path, 9)
    newest = _fake_checkpoint(tmp_path, 12)
    (newest / "optimizer_0" / "__0_0.distcp").write_bytes(b"x" * 50)  # truncated shard
    missing = _fake_checkpoint(tmp_path, 11)
    (missing / "random_states_0.pkl").unlink()
    no_marker = _fake_checkpoint(tmp_path, 10)
    (no_marker / "COMPLETE.json").unlink()
    _fake_checkpoint(tmp_path, 13, complete=False)
    warnings: list[str] = []
    found = checkpoints.find_resumable(tmp_path, warnings.append)
    assert found is not None and found[0].name == "step_00000009"
    text = "\n".join(warnings)
    assert "step_00000012" in text and "truncated" in text
    assert "step_00000011" in text and "missing file" in text
    assert "step_00000010" in text and "no COMPLETE.json" in text


def test_prune_keeps_last_k_complete(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 5, complete=False)
    checkpoints.prune(tmp_path, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000004"]


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert checkpoints.find_resumable(tmp_path, lambda _line: None) is None
