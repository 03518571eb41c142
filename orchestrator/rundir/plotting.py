"""Plot a run's loss and throughput to a PNG.

Throughput is tokens/s where the run logs it (``train/``); a Trainer or ``orchestrator.loop`` run logs
no tokens, only each step's time, so its panel shows steps/s; a run with neither gets no panel at all,
never an empty axis.

matplotlib is imported inside :func:`plot_run` (with the non-interactive Agg backend) because
importing it costs ~0.3 s and every other command must stay fast; Agg also works on cluster login
nodes that have no display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import read_job_json
from orchestrator.rundir.series import RunSeries, load_series

__all__ = ["RunSeries", "load_series", "plot_run", "throughput"]


def throughput(series: RunSeries) -> tuple[str, list[int], list[float]] | None:
    """The throughput curve to draw: tokens/s when the run logs it, else steps/s (from each logged
    step's time: Trainer and loop runs), else None (no panel)."""
    if series.tps_steps:
        return "tokens/s", series.tps_steps, series.tokens_per_s
    if series.sps_steps:
        return "steps/s", series.sps_steps, series.steps_per_s
    return None


def plot_run(run_dir: Path | str, out_png: Path | str, job_id: str | None = None) -> Path:
    """Write a PNG: loss (train + val) vs step and, below, the :func:`throughput` panel when the run has
    one (tokens/s or steps/s vs step); resumes as dashed lines.

    Raises RunFailure if the run has no train or eval events yet (nothing to draw).
    """
    run_dir = Path(run_dir)
    out = Path(out_png)
    series = load_series(run_dir)
    if not series.train_steps and not series.val_steps:
        raise RunFailure(f"no train or eval events in {run_dir / 'metrics.jsonl'} yet; nothing to plot")
    job = read_job_json(run_dir)
    strategy = series.strategy or job.get("strategy") or "?"
    world = series.world_size
    if world is None and isinstance(job.get("nodes"), int) and isinstance(job.get("procs_per_node"), int):
        world = job["nodes"] * job["procs_per_node"]

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rate = throughput(series)
    if rate is not None:
        fig, (ax_loss, ax_rate) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, constrained_layout=True)
        axes: tuple[Any, ...] = (ax_loss, ax_rate)
    else:
        fig, ax_loss = plt.subplots(1, 1, figsize=(10, 4), constrained_layout=True)
        axes = (ax_loss,)
    try:
        if series.train_steps:
            ax_loss.plot(series.train_steps, series.train_loss, label="train loss", color="tab:blue", lw=1.2)
        if series.val_steps:
            ax_loss.plot(
                series.val_steps,
                series.val_loss,
                label="val loss",
                color="tab:orange",
                marker="o",
                ms=4,
                lw=1.5,
            )
        ax_loss.set_ylabel("loss")
        ax_loss.grid(True, alpha=0.3)

        if rate is not None:
            unit, steps, values = rate
            # A Trainer logs a step's time at most once a second: a short run may have one point,
            # which a bare line would not draw.
            marker = "o" if len(steps) == 1 else None
            ax_rate.plot(steps, values, color="tab:green", lw=1.2, marker=marker, ms=4, label=unit)
            ax_rate.set_ylabel(unit)
            ax_rate.grid(True, alpha=0.3)
        axes[-1].set_xlabel("step")

        for i, (step, ckpt) in enumerate(series.resumes):
            for ax in axes:
                ax.axvline(step, color="tab:red", ls="--", lw=1.2, label="resume" if i == 0 else None)
            label = f"resume @ {step}"
            if ckpt:
                label += f"\n{Path(ckpt).name}"
            ax_loss.annotate(
                label,
                xy=(step, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                va="top",
                fontsize=8,
                color="tab:red",
            )
        ax_loss.legend(loc="upper right")
        title_id = job_id or job.get("job_id") or run_dir.name
        fig.suptitle(
            f"job {title_id} — strategy {strategy} — world size {world if world is not None else '?'}"
        )
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out, dpi=100)
        except OSError as exc:  # -o /proc/x.png, a read-only or full disk: one line, not a traceback
            raise UserError(f"cannot write the plot to {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out
