"""Promises of the docs (docs/*.md) that had no launched test (issue 33, item 7), and two of issue 27's polish items, on the
``local`` profile through ``orchestrator submit``: small jobs (1 node x 2 processes, a few steps).

Each test asserts what a broken implementation gets wrong: the hooks still installed under
``--no-script-hooks``, an option rendered but not applied, bf16 silently off, DeepSpeed clipping at
its default 1.0, a checkpoint written sharded or not loaded, no PREEMPTED on the profile's signal, the
wrong best task, a sweep task started after ``Sweep.cancel``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import REPO, job_and_run_dir, poll, run_cli, status_row, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_local_jobs")]

PROBE = str(REPO / "tests" / "scripts" / "prepared_model.py")
TRAIN = str(REPO / "train" / "train.py")
TINY = ["--preset", "tiny", "--data", "synthetic"]
ONE_NODE = ["--profile", "local", "--nodes", "1", "--procs-per-node", "2"]
DEEPSPEED_WARNING = "Setting accelerator to CPU"


def submit(env: dict[str, str], options: list[str], script_args: list[str], timeout: float = 150) -> Any:
    return run_cli(
        ["submit", *ONE_NODE, *options, "--wait", "--poll", "0.5", "--", *script_args], env, timeout
    )


def probe(env: dict[str, str], tmp_path: Path, options: list[str]) -> tuple[Any, list[dict]]:
    """The probe script under ``options``; its per-rank records (what Accelerate made of the model)."""
    out = tmp_path / "probe"
    res = submit(env, options, [PROBE, "--out", str(out)])
    records = [
        json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2) if Path(f"{out}.rank{r}").exists()
    ]
    return res, records


def node_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").rglob("*.log")))


# -- issue 27 polish: no DeepSpeed warning in jobs without DeepSpeed; a throughput panel with data


@pytest.mark.parametrize(
    "script, args",
    [
        ("examples/trainer_cnn.py", ["--max-steps", "12", "--samples", "256", "--logging-steps", "2"]),
        ("examples/accelerate_cnn.py", ["--max-steps", "12", "--samples", "256", "--save-every", "6"]),
    ],
    ids=["trainer", "loop"],
)
def test_trainer_and_loop_runs_log_no_deepspeed_warning_and_plot_steps_per_s(
    orch_env: dict[str, str], tmp_path: Path, script: str, args: list[str]
) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    extra = ["--output-dir", str(tmp_path / "out")] if "trainer" in script else []
    res = submit(orch_env, ["--strategy", "ddp"], [str(REPO / script), *args, *extra])
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    logs = node_logs(run_dir)
    # accelerate's unwrap_model (every Trainer(), save_state) imported deepspeed, whose import warned on
    # every rank of a CPU job; the rank's site hook now asks only once deepspeed is imported.
    assert "self-check ok" in logs, logs[-3000:]
    assert DEEPSPEED_WARNING not in logs, [line for line in logs.splitlines() if DEEPSPEED_WARNING in line]

    from orchestrator.rundir.plotting import load_series

    series = load_series(run_dir)
    assert not series.tps_steps and series.sps_steps, series  # no tokens/s logged: steps/s from step times
    plot = run_cli(["plot", job_id, "-o", str(tmp_path / "plot.png")], orch_env, timeout=120)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    img = mpimg.imread(tmp_path / "plot.png")
    assert img.shape[:2] == (700, 1000)  # two panels: loss, and throughput
    # The throughput curve is tab:green (#2ca02c), in the lower panel: it has data, not an empty axis.
    green = np.all(np.abs(img[..., :3] - np.array([0x2C, 0xA0, 0x2C]) / 255) < 0.12, axis=-1)
    rows = np.nonzero(green.any(axis=1))[0]
    assert rows.size and rows.min() > img.shape[0] / 2, rows


def test_a_run_without_any_throughput_gets_no_empty_panel(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    from orchestrator.rundir.plotting import plot_run

    run = tmp_path / "r"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"strategy": "ddp", "nodes": 1, "procs_per_node": 2}))
    events = [{"event": "train", "step": s, "loss": 3.0 / s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    img = mpimg.imread(plot_run(run, tmp_path / "p.png"))
    assert img.shape[:2] == (400, 1000)  # the loss panel alone


# -- --no-script-hooks, --activation-checkpointing, bf16 on CPU (the probe script, unchanged)


def test_no_script_hooks_runs_the_script_exactly_as_written(orch_env: dict[str, str], tmp_path: Path) -> None:
    # With the hooks this job stops at start (exit 3: the model has no NoSuchBlock). Without them the
    # script meets Accelerate alone: on CPU it drops FSDP and runs DDP, as docs/your-script.md warns.
    options = ["--strategy", "full_shard", "--wrap-cls", "NoSuchBlock", "--no-script-hooks"]
    res, records = probe(orch_env, tmp_path, options)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["hooked"] for r in records] == [False, False], records
    assert {r["distributed_type"] for r in records} == {"MULTI_CPU"}, records
    _, run_dir = job_and_run_dir(res.stdout)
    assert "self-check" not in node_logs(run_dir)


def test_activation_checkpointing_wraps_every_layer(orch_env: dict[str, str], tmp_path: Path) -> None:
    options = ["--strategy", "full_shard", "--wrap-cls", "Block", "--activation-checkpointing"]
    res, records = probe(orch_env, tmp_path, options)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["checkpoint_wrappers"] for r in records] == [2, 2], records  # both Blocks recompute
    assert {r["distributed_type"] for r in records} == {"FSDP"} and all(r["finite"] for r in records), records


def test_bf16_on_cpu_autocasts_with_fp32_parameters(orch_env: dict[str, str], tmp_path: Path) -> None:
    res, records = probe(orch_env, tmp_path, ["--strategy", "ddp", "--mixed-precision", "bf16"])
    assert res.returncode == 0, res.stdout + res.stderr
    for r in records:
        # Autocast precision: compute in bf16, parameters (and the optimizer's state) stay fp32.
        assert r["inner_dtype"] == "torch.bfloat16" and r["param_dtypes"] == ["torch.float32"], r
        assert r["finite"] and len(r["losses"]) == 3, r
    assert len(records) == 2


# -- DeepSpeed ZeRO-1 and --gradient-clipping 0 (train/)


def test_deepspeed_zero1_without_clipping_equals_unclipped_ddp(orch_env: dict[str, str]) -> None:
    args = [TRAIN, *TINY, "--max-steps", "6", "--clip", "0", "--lr", "3e-2", "--warmup-steps", "1"]
    ddp = submit(orch_env, ["--strategy", "ddp"], args)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    zero1 = submit(orch_env, ["--strategy", "deepspeed_zero1", "--gradient-clipping", "0"], args)
    assert zero1.returncode == 0, zero1.stdout + zero1.stderr
    _, ddp_dir = job_and_run_dir(ddp.stdout)
    _, zero_dir = job_and_run_dir(zero1.stdout)
    logs = node_logs(zero_dir)
    assert "DeepSpeed ZeRO-1 over 2 ranks" in logs, logs[-3000:]
    assert "clips gradients at" not in logs  # train/ says so when DeepSpeed's clipping differs from --clip 0
    # Clipping at DeepSpeed's default 1.0 would have changed a step: a norm is above it.
    norms = [
        e["grad_norm"]
        for e in map(json.loads, (ddp_dir / "metrics.jsonl").read_text().splitlines())
        if e.get("event") == "train"
    ]
    assert max(norms) > 1.0, norms
    ours, reference = train_losses(zero_dir), train_losses(ddp_dir)
    assert len(ours) == len(reference) == 6
    assert ours == pytest.approx(reference, rel=1e-5), (ours, reference)


# -- --state-dict full: written and resumed


def test_full_state_dict_checkpoint_is_written_and_resumed(orch_env: dict[str, str]) -> None:
    options = ["--strategy", "full_shard", "--wrap-cls", "TransformerBlock", "--state-dict", "full"]
    args = [TRAIN, *TINY, "--max-steps", "30", "--ckpt-every", "2"]
    res = run_cli(["submit", *ONE_NODE, *options, "--", *args], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    poll(lambda: list((run_dir / "checkpoints").glob("step_*/COMPLETE.json")), 120, "a complete checkpoint")
    assert run_cli(["cancel", job_id, "--signal", "USR2"], orch_env, timeout=60).returncode == 0
    res = run_cli(["wait", job_id, "--timeout", "120"], orch_env, timeout=150)
    assert res.returncode == 1 and "PREEMPTED" in res.stdout, res.stdout + res.stderr
    newest = max((run_dir / "checkpoints").glob("step_*"))
    step = int(newest.name.split("_")[1])
    names = {p.name for p in newest.iterdir()}
    assert not any(n.startswith("pytorch_model_fsdp_") and (newest / n).is_dir() for n in names), names
    assert names & {"pytorch_model_fsdp.bin", "model.safetensors", "pytorch_model.bin"}, (
        names
    )  # one full file

    marker = json.loads((newest / "COMPLETE.json").read_text())  # before the resumed run rotates it away

    res = run_cli(["resume", job_id], orch_env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    new_job = res.stdout.split("submitted job ")[1].split()[0]
    res = run_cli(["wait", new_job, "--timeout", "150"], orch_env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    loaded = json.loads((run_dir / "loaded.json").read_text())  # train/ checks the checksums it restored
    assert loaded["step"] == step and loaded["checkpoint"] == str(newest), loaded
    assert loaded["param_checksum"] == pytest.approx(marker["param_checksum"], rel=1e-12), (loaded, marker)


# -- the local profile's pre-timeout signal, and its --auto-resume refusal


def test_the_local_pre_timeout_signal_ends_the_job_preempted_in_a_group_shared_run_dir(
    orch_env: dict[str, str], tmp_path: Path
) -> None:
    import yaml

    profile = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    profile["signal"] = {"name": "USR2", "seconds_before": 48}  # 1 min limit: the signal after 12 s
    profile["share_with_group"] = True  # the same job shows the key's modes (issue 33 item 7)
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "local.yaml").write_text(yaml.safe_dump(profile))
    env = {**orch_env, "ORCHESTRATOR_PROFILES": str(folder)}
    args = [TRAIN, *TINY, "--max-steps", "100000", "--log-every", "5"]
    res = run_cli(
        ["submit", *ONE_NODE, "--time", "1", "--wait", "--poll", "0.5", "--", *args], env, timeout=150
    )
    assert res.returncode == 1 and "PREEMPTED" in res.stdout, res.stdout + res.stderr
    job_id, run_dir = job_and_run_dir(res.stdout)
    from orchestrator.contract.run_dir import read_exit_status

    stopped = read_exit_status(run_dir)
    assert stopped is not None and stopped["reason"] == "signal", stopped
    assert (run_dir / "checkpoints" / f"step_{int(stopped['step']):08d}" / "COMPLETE.json").exists()
    assert status_row(env, job_id)["state"] == "PREEMPTED"
    # A stop for a requeue is no crash: one line in submitit's log, no traceback.
    (err,) = (run_dir / "submitit").glob("*_log.err")
    assert "training stopped for a requeue on node" in err.read_text(), err.read_text()[-2000:]
    assert "Traceback" not in err.read_text(), err.read_text()[-2000:]
    # share_with_group: the run directory, its logs and checkpoints readable by the group, never writable.
    modes = {str(p.relative_to(run_dir)): p.stat().st_mode & 0o777 for p in [run_dir, *run_dir.rglob("*")]}
    assert modes["."] == 0o750, modes
    dirs = {name for name in modes if (run_dir / name).is_dir()}
    assert {modes[d] for d in dirs} == {0o750}, {d: oct(modes[d]) for d in dirs if modes[d] != 0o750}
    files = {n: m for n, m in modes.items() if n not in dirs}
    assert any(n.startswith("logs/") for n in files) and any(n.startswith("checkpoints/") for n in files)
    # Lock files (.alive.lock, the run lock) stay owner-only: only the owner's processes take them.
    wrong = {n: oct(m) for n, m in files.items() if m not in (0o640, 0o750) and not n.endswith(".lock")}
    assert wrong == {}, wrong


def test_auto_resume_is_refused_on_the_local_profile(orch_env: dict[str, str], tmp_path: Path) -> None:
    res = run_cli(["submit", *ONE_NODE, "--auto-resume", "--", TRAIN, *TINY], orch_env, timeout=60)
    assert res.returncode == 2 and "--auto-resume" in res.stderr, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


# -- sweeps: status SWEEP --metric, Sweep.cancel


def _last(run_dir: Path, event: str, key: str) -> float:
    values = [
        e[key]
        for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if e.get("event") == event and key in e
    ]
    return float(values[-1])


def test_status_sweep_ranks_tasks_by_val_loss_and_tokens_per_s(orch_env: dict[str, str]) -> None:
    res = run_cli(
        [
            "sweep",
            "--profile",
            "local",
            "--nodes",
            "1",
            "--procs-per-node",
            "1",
            "--max-parallel",
            "2",
            "--grid",
            "lr=3e-2,1e-4",
            "--wait",
            "--",
            TRAIN,
            *TINY,
            "--max-steps",
            "8",
            "--lr",
            "{lr}",
        ],
        orch_env,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_id = res.stdout.split("submitted sweep ")[1].split()[0]
    for metric, event, pick in (("val_loss", "eval", min), ("tokens_per_s", "train", max)):
        out = run_cli(["status", sweep_id, "--metric", metric, "--json"], orch_env, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        data = json.loads(out.stdout)
        values = [_last(Path(t["run_dir"]), event, metric) for t in data["tasks"]]
        assert len(values) == 2 and values[0] != values[1], values
        assert data["best_task"] == values.index(pick(values)), (metric, values, data)
        text = run_cli(["status", sweep_id, "--metric", metric], orch_env, timeout=60).stdout
        assert metric in text or metric.replace("_", " ") in text, text


def test_sweep_cancel_ends_the_running_task_and_starts_no_other(orch_env: dict[str, str]) -> None:
    import orchestrator

    sweep = orchestrator.sweep(
        profile="local",
        nodes=1,
        procs_per_node=1,
        script=TRAIN,
        args=[*TINY, "--max-steps", "100000", "--lr", "{lr}"],
        grid={"lr": [1e-3, 2e-3]},
        max_parallel=1,
    )
    first = poll(lambda: sweep.jobs, 60, "the first task submitted")[0]
    poll(lambda: (first.run_dir / "metrics.jsonl").exists(), 120, "the first task training")
    lines = sweep.cancel()
    assert lines, lines
    assert first.wait(timeout=120).value == "CANCELLED"
    states = sweep.wait(timeout=120)
    assert list(states.values()) == ["CANCELLED"] or all(s.value != "COMPLETED" for s in states.values()), (
        states
    )
    assert len(sweep.jobs) == 1, [j.job_id for j in sweep.jobs]  # the second task was never started
