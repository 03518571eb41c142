"""Plot a run's loss and throughput to a PNG.

Throughput is tokens/s where the run logs it (``train/``); a Trainer or ``orchestrator.loop`` run logs
no tokens, only each step's time, so its panel shows steps/s; a run with neither gets no panel at all,
never an empty axis.

matplotlib is imported inside :func:`plot_run` (with the non-interactive Agg backend) because
importing it costs ~0.3 s and every other command must stay fast; Agg also works on cluster login
nodes that have no display.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import RunFailure, UserError
from orchestrator.contract.run_dir import read_job_json
from orchestrator.core.run_summary import iter_metrics


@dataclass
class RunSeries:
    """The curves of one run, read in a single streaming pass over metrics.jsonl."""

    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    tps_steps: list[int] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    sps_steps: list[int] = field(default_factory=list)
    steps_per_s: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    resumes: list[tuple[int, str]] = field(default_factory=list)
    strategy: str | None = None
    world_size: int | None = None


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def load_series(run_dir: Path | str) -> RunSeries:
    """Collect train loss, tokens/s, val loss and resume points (events with bad fields are skipped).

    After a resume the steps between the checkpoint and the crash are trained (and logged) again;
    the later value wins for each step, so the curve follows the run that actually continued
    instead of doubling back on itself.
    """
    s = RunSeries()
    loss: dict[int, float] = {}
    tps: dict[int, float] = {}
    sps: dict[int, float] = {}
    val: dict[int, float] = {}
    for e in iter_metrics(Path(run_dir)):
        kind, step = e.get("event"), e.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        if kind == "train":
            if _is_num(e.get("loss")):
                loss[step] = float(e["loss"])
            if _is_num(e.get("tokens_per_s")):
                tps[step] = float(e["tokens_per_s"])
            if _is_num(e.get("step_time_s")) and e["step_time_s"] > 0:
                sps[step] = 1.0 / float(e["step_time_s"])
            if isinstance(e.get("strategy"), str):
                s.strategy = e["strategy"]
            if isinstance(e.get("world_size"), int):
                s.world_size = e["world_size"]
        elif kind == "eval" and _is_num(e.get("val_loss")):
            val[step] = float(e["val_loss"])
        elif kind == "resume":
            s.resumes.append((step, str(e.get("checkpoint") or "")))
    s.train_steps, s.train_loss = _sorted(loss)
    s.tps_steps, s.tokens_per_s = _sorted(tps)
    s.sps_steps, s.steps_per_s = _sorted(sps)
    s.val_steps, s.val_loss = _sorted(val)
    return s


def _sorted(points: dict[int, float]) -> tuple[list[int], list[float]]:
    steps = sorted(points)
    return steps, [points[k] for k in steps]


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
