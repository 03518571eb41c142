"""DeepSpeed ZeRO on CPU, for real: 2 ranks over gloo through the orchestrator's rendered configs and node
environment (no ``ACCELERATE_USE_CPU``, the gloo backend from ``orchestrator/rank/site``).

The oracle is the DDP run of tests/train/test_equivalence.py (each batch a pure function of step and
rank): ZeRO-2 and ZeRO-3 clip at 1.0 like train.py's DDP, so their losses equal DDP's up to float32
summation order (measured: at most 4.8e-7 over 20 steps; the tolerance is 2e-6).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import load_profile
from orchestrator.node.entry import training_environment
from orchestrator.node.site_path import NODE_SITE_DIR
from tests.helpers import train_launch as tl
from tests.helpers.cli import REPO, job_and_run_dir, run_cli
from tests.helpers.run_dirs import marker_path

STEPS = 20
ARGS = ("--max-steps", str(STEPS))
LOSS_TOLERANCE = 2e-6


# ----------------------------------------------------------------------------- no training


def _plan(strategy: str, **options: object):
    name, _, profile = load_profile("local")
    return build_plan(name, profile, merge_options(profile, strategy=strategy, **options), "train/train.py")


def test_node_environment_for_deepspeed_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ACCELERATE_USE_CPU would turn DeepSpeed into MULTI_CPU DDP: never set for it, even when inherited."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    node = SimpleNamespace(job_id="7", node_rank=0, memory_key="node0", device_environment=lambda plan: {})
    env = training_environment(_plan("deepspeed_zero3"), node, tmp_path, 0)  # type: ignore[arg-type]
    assert "ACCELERATE_USE_CPU" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == NODE_SITE_DIR
    assert Path(NODE_SITE_DIR, "sitecustomize.py").is_file()
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["ORCHESTRATOR_STRATEGY"] == "deepspeed_zero3"
    ddp = training_environment(_plan("ddp"), node, tmp_path, 0)  # type: ignore[arg-type]
    assert ddp["ACCELERATE_USE_CPU"] == "1"
    # Every launch gets the node site (the script hooks), and the switch says whether they act.
    assert ddp["PYTHONPATH"].split(os.pathsep)[0] == NODE_SITE_DIR and ddp["ORCHESTRATOR_SCRIPT_HOOKS"] == "1"
    off = training_environment(_plan("ddp", script_hooks=False), node, tmp_path, 1)  # type: ignore[arg-type]
    assert off["ORCHESTRATOR_SCRIPT_HOOKS"] == "0"
    # Trackers: one run id for every attempt of a run, another for another run.
    assert off["WANDB_RUN_ID"] == ddp["WANDB_RUN_ID"] and off["WANDB_RESUME"] == "allow"
    other = training_environment(_plan("ddp"), node, tmp_path / "other", 0)  # type: ignore[arg-type]
    assert other["WANDB_RUN_ID"] != ddp["WANDB_RUN_ID"]
    assert ddp["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tensorboard")


def test_node_site_supplies_gloo_and_skips_the_jit_shm_op() -> None:
    """In a rank's interpreter: Accelerate's missing backend becomes gloo, DeepSpeed compiles nothing,
    and only for DeepSpeed launches (ACCELERATE_USE_DEEPSPEED, set by `accelerate launch`)."""
    code = (
        "import importlib, accelerate.state as s\n"
        "t = importlib.import_module('deepspeed.comm.torch')\n"
        "ps = s.PartialState.__new__(s.PartialState)\n"
        "print(getattr(s.PartialState._prepare_backend, '_orchestrator_gloo', False), t.build_shm_op(),"
        " ps._prepare_backend(False, False, None)[0])\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    base["PYTHONPATH"] = NODE_SITE_DIR
    env = {**base, "ACCELERATE_USE_DEEPSPEED": "true", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["True", "None", "gloo"], out.stdout + out.stderr
    off = subprocess.run(
        [sys.executable, "-c", "import accelerate.state as s; print(hasattr(s.PartialState._prepare_backend, "
         "'_orchestrator_gloo'))"],
        env=base, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert off.stdout.strip() == "False", off.stdout + off.stderr


def test_render_shows_the_deepspeed_config_file(orch_env: dict[str, str]) -> None:
    res = run_cli(
        ["render", "--profile", "local", "--strategy", "deepspeed_zero2", "--gradient-clipping", "0", "--",
         "train/train.py"], orch_env, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "distributed_type: DEEPSPEED" in out and "deepspeed_multinode_launcher: standard" in out
    assert "==> deepspeed_config.node0.json <==" in out and '"gradient_clipping": 0.0' in out
    assert "\nmixed_precision:" not in out  # Accelerate refuses it next to a config file
    refused = run_cli(
        ["render", "--profile", "local", "--strategy", "deepspeed_zero2", "--offload-params", "--", "x.py"],
        orch_env, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "error: --offload-params: ZeRO-3 only" in refused.stderr, (
        refused.stderr
    )


# ----------------------------------------------------------------------------- training


def _zero_run(strategy: str) -> tl.Launch:
    return tl.cached_run(strategy, 2, 1, 2, ARGS)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_zero_losses_equal_ddp(strategy: str) -> None:
    ddp, zero = tl.cached_run("ddp", 2, 1, 2, ARGS), _zero_run(strategy)
    tl.assert_ok(ddp)
    tl.assert_ok(zero)
    ref, got = tl.losses(ddp.run_dir), tl.losses(zero.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), zero.output()
    diffs = {s: (ref[s], got[s]) for s in ref if abs(ref[s] - got[s]) > LOSS_TOLERANCE}
    assert not diffs, f"{strategy}: losses differ from DDP's at {diffs}"
    records = tl.read_metrics(zero.run_dir)
    assert {r["strategy"] for r in records} == {strategy} and {r["world_size"] for r in records} == {2}
    assert all(r["grad_norm"] > 0 for r in records)  # the engine's norm, not a placeholder
    final, ref_final = tl.read_json(zero.run_dir / "final.json"), tl.read_json(ddp.run_dir / "final.json")
    assert final["param_checksum"] == pytest.approx(ref_final["param_checksum"], rel=1e-6)
    out = zero.output()
    assert f"strategy {strategy} (DeepSpeed ZeRO-{strategy[-1]} over 2 ranks" in out, out
    if strategy == "deepspeed_zero3":
        held, full = map(int, re.search(r"this rank holds (\d+) of (\d+) parameters", out).groups())  # type: ignore[union-attr]
        assert full > 800_000 and held <= full // 2 + 100, (held, full)  # really partitioned


@pytest.mark.slow
def test_zero3_usr2_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    baseline = _zero_run("deepspeed_zero3")
    tl.assert_ok(baseline)
    run_dir = tmp_path / "run"
    launch = tl.start(run_dir, "deepspeed_zero3", 2, 1, 2, list(ARGS))
    try:
        launch.poll_until(lambda: max(tl.losses(run_dir), default=0) >= 5, 150, "step 5")
        workers = launch.workers()
        assert len(workers) == 2, [w.cmdline() for w in workers]
        max(workers, key=lambda w: w.pid).send_signal(signal.SIGUSR2)  # one rank: they agree to stop
        launch.wait(timeout=90)
    finally:
        launch.kill()
    status = tl.read_json(run_dir / "exit_status.json")
    assert status["code"] == 75 and status["reason"] == "signal", launch.output()
    stopped = status["step"]
    assert 5 <= stopped < STEPS and marker_path(run_dir, stopped).exists()
    folder = marker_path(run_dir, stopped).parent
    assert sorted(p.name for p in (folder / "pytorch_model").glob("zero_pp_rank_*_model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    resumed = tl.run(run_dir, "deepspeed_zero3", 2, 1, 2, list(ARGS))
    tl.assert_ok(resumed)
    ref, got = tl.losses(baseline.run_dir), tl.losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), "a step was lost or repeated"
    assert [got[s] for s in ref] == [ref[s] for s in ref], {s: (ref[s], got[s]) for s in ref}  # bit-equal
    loaded, saved = tl.read_json(run_dir / "loaded.json"), tl.read_json(marker_path(run_dir, stopped))
    assert loaded["step"] == stopped
    assert (loaded["param_checksum"], loaded["optim_checksum"]) == (
        saved["param_checksum"],
        saved["optim_checksum"],
    )
    assert saved["optim_checksum"] != 0.0
    final, ref_final = tl.read_json(run_dir / "final.json"), tl.read_json(baseline.run_dir / "final.json")
    assert (final["param_checksum"], final["optim_checksum"]) == (
        ref_final["param_checksum"],
        ref_final["optim_checksum"],
    )


@pytest.mark.slow
def test_zero3_checkpoint_in_a_zero2_run_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Another ZeRO stage cannot load the partitions (another world size can: tests/runner/test_resume_zero_reshard.py)."""
    baseline = _zero_run("deepspeed_zero3")
    tl.assert_ok(baseline)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    subprocess.run(
        ["cp", "-a", str(marker_path(baseline.run_dir, STEPS).parent), str(run_dir / "checkpoints")],
        check=True,
    )
    started = time.monotonic()
    launch = tl.run(run_dir, "deepspeed_zero2", 2, 1, 2, [*ARGS[:1], str(STEPS + 5)], timeout=120)
    assert launch.returncodes and all(code != 0 for code in launch.returncodes)
    status = tl.read_json(run_dir / "exit_status.json")
    assert status["code"] == 4 and status["reason"] == "checkpoint cannot be resumed", status
    (problem,) = status["problems"]
    assert problem == (
        "checkpoint written by deepspeed_zero3, this run is deepspeed_zero2: resume with the same ZeRO stage"
    )
    assert "cannot resume from" in launch.output()
    assert not tl.read_metrics(run_dir), "a step ran"
    assert time.monotonic() - started < 100


@pytest.mark.slow
def test_zero3_checkpoint_exports_consolidated_fp32(tmp_path: Path) -> None:
    import torch

    from train.checksum import tensor_checksum

    baseline = _zero_run("deepspeed_zero3")
    tl.assert_ok(baseline)
    out = tmp_path / "model_fp32"
    res = run_cli(
        ["export", "--checkpoint", str(marker_path(baseline.run_dir, STEPS).parent), "--format", "torch",
         "--out", str(out), "--verify"],
        dict(os.environ),
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert sum(v.numel() for v in state.values()) >= 800_000
    final = tl.read_json(baseline.run_dir / "final.json")
    assert tensor_checksum(state) == pytest.approx(final["param_checksum"], rel=1e-12)


@pytest.mark.slow
def test_deepspeed_silently_off_fails_the_selfcheck(tmp_path: Path) -> None:
    """ACCELERATE_USE_CPU=1 (what CPU profiles set for DDP/FSDP) makes a DeepSpeed config MULTI_CPU DDP, with
    the right world size and no error; the self-check stops it before a step."""
    started = time.monotonic()
    launch = tl.run(tmp_path / "run", "deepspeed_zero3", 2, 1, 2, ["--max-steps", "3"], timeout=90,
                    env={"ACCELERATE_USE_CPU": "1"})  # fmt: skip
    out = launch.output()
    assert launch.returncodes and all(code != 0 for code in launch.returncodes), out
    assert "SELF-CHECK FAILED (exit 3)" in out, out
    assert "DeepSpeed asked for (deepspeed_zero3), not active: found distributed type MULTI_CPU" in out, out
    assert "ACCELERATE_USE_CPU=1 is set" in out
    assert tl.read_json(tmp_path / "run" / "exit_status.json")["code"] == 3
    assert not tl.read_metrics(tmp_path / "run"), "a training step ran"
    assert time.monotonic() - started < 90


@pytest.mark.slow
def test_unmodified_script_gets_zero3_with_the_asked_world_size(
    orch_env: dict[str, str], reap_local_jobs: None
) -> None:
    out = Path(orch_env["ORCHESTRATOR_RUNS"]).parent / "plain"
    res = run_cli(
        ["submit", "--profile", "local", "--strategy", "deepspeed_zero3", "--wait", "--",
         str(REPO / "tests" / "scripts" / "plain_deepspeed.py"), "--out", str(out)],
        orch_env, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    _, run_dir = job_and_run_dir(res.stdout)
    records = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    for record in records:
        assert record["world_size"] == 2 and record["distributed_type"] == "DEEPSPEED", record
        assert record["zero_stage"] == 3 and record["local_numel"] == 0, record
        assert record["partition_numel"] * 2 >= record["model_numel"] > record["partition_numel"], record
    assert records[0]["losses"] == records[1]["losses"] and len(records[0]["losses"]) == 3
    # DeepSpeed's ranks are forked from the launcher's imports, as DDP/FSDP's (they were torchrun's
    # before: a second import of torch on every rank).
    node_log = (run_dir / "logs" / "attempt_0" / "node_0.log").read_text()
    assert "started 2 rank(s) by fork" in node_log and "ranks started by torchrun" not in node_log, node_log
