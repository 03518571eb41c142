"""``plot_run`` and ``orchestrator plot``: a real PNG with two panels, resume lines, sensible errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from orchestrator.contract.errors import RunFailure
from orchestrator.contract.job_states import JobState
from orchestrator.registry.store import Registry
from orchestrator.rundir.plotting import load_series, plot_run
from tests.helpers.cli import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir: Path) -> None:
    """120 steps, a crash at 75, resume from the step-60 checkpoint, evals every 20 steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps({"strategy": "fsdp2", "nodes": 2, "procs_per_node": 2}))
    t = 0.0
    with open(run_dir / "metrics.jsonl", "w") as fh:

        def w(ev: dict[str, object]) -> None:
            fh.write(json.dumps(ev) + "\n")

        for s in range(1, 76):
            t += 1
            w(
                {
                    "event": "train",
                    "step": s,
                    "max_steps": 120,
                    "loss": 5.0 * math.exp(-s / 40) + 0.5,
                    "lr": 1e-3,
                    "tokens_per_s": 20000 + 50 * (s % 5),
                    "step_time_s": 0.1,
                    "world_size": 4,
                    "strategy": "fsdp2",
                    "time": t,
                }
            )
            if s % 20 == 0:
                w({"event": "eval", "step": s, "val_loss": 5.0 * math.exp(-s / 40) + 0.6, "time": t})
        w(
            {
                "event": "resume",
                "step": 60,
                "checkpoint": str(run_dir / "checkpoints" / "step_00000060"),
                "time": t + 30,
            }
        )
        for s in range(61, 121):
            t += 1
            w(
                {
                    "event": "train",
                    "step": s,
                    "max_steps": 120,
                    "loss": 5.0 * math.exp(-s / 40) + 0.45,
                    "lr": 1e-3,
                    "tokens_per_s": 15000 + 50 * (s % 5),
                    "step_time_s": 0.13,
                    "world_size": 4,
                    "strategy": "fsdp2",
                    "time": t,
                }
            )
            if s % 20 == 0:
                w({"event": "eval", "step": s, "val_loss": 5.0 * math.exp(-s / 40) + 0.55, "time": t})
        fh.write('{"event": "train", "step": 121, "lo')  # torn


def test_series_keep_the_continued_run(tmp_path: Path) -> None:
    make_run(tmp_path / "r")
    s = load_series(tmp_path / "r")
    assert s.train_steps == list(range(1, 121))  # steps 61..75 trained twice: the later values win
    assert s.train_loss[69] == pytest.approx(5.0 * math.exp(-70 / 40) + 0.45)
    assert s.val_steps == [20, 40, 60, 80, 100, 120]
    assert s.resumes == [(60, str(tmp_path / "r" / "checkpoints" / "step_00000060"))]
    assert (s.strategy, s.world_size) == ("fsdp2", 4)


def test_plot_run_writes_a_two_panel_png(tmp_path: Path) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    make_run(tmp_path / "r")
    out = plot_run(tmp_path / "r", tmp_path / "out" / "plot.png", job_id="123")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    img = mpimg.imread(out)
    assert img.shape[0] == 700 and img.shape[1] == 1000
    rgb = img[..., :3]
    # the resume line is tab:red (#d62728): some pixels of that colour exist in both panels
    red = np.all(np.abs(rgb - np.array([0xD6, 0x27, 0x28]) / 255) < 0.12, axis=-1)
    rows = np.nonzero(red.any(axis=1))[0]
    assert rows.size and rows.min() < img.shape[0] / 2 < rows.max()


def test_plot_needs_data(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    with pytest.raises(RunFailure, match="nothing to plot"):
        plot_run(tmp_path / "r", tmp_path / "x.png")


def test_plot_cli(orch_env: dict[str, str], tmp_path: Path) -> None:
    rd = tmp_path / "runs" / "77"
    make_run(rd)
    with Registry.open(Path(orch_env["ORCHESTRATOR_HOME"])) as reg:
        reg.add_job(
            job_id="77",
            name="p",
            profile="slurm_test",
            scheduler="slurm",
            strategy="fsdp2",
            nodes=2,
            procs_per_node=2,
            command=["python"],
            run_dir=rd,
            state=JobState.COMPLETED,
        )
    res = run_cli(["plot", "77"], orch_env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == rd / "plot.png" and (rd / "plot.png").read_bytes()[:8] == PNG_MAGIC
    out = tmp_path / "custom.png"
    assert run_cli(["plot", "77", "-o", str(out)], orch_env, timeout=120).returncode == 0 and out.exists()
    bad = run_cli(["plot", "77", "-o", str(tmp_path / "x.pdf")], orch_env, timeout=60)
    assert bad.returncode == 2 and "PNG" in bad.stderr
    unknown = run_cli(["plot", "nope"], orch_env, timeout=60)
    assert unknown.returncode == 2 and "unknown job id 'nope'" in unknown.stderr
