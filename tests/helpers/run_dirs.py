"""Run directories made by hand: metrics events and checkpoints, as training writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.rundir.summary import iter_metrics


def train_event(step: int, t: float, max_steps: int = 100, **kw: Any) -> dict[str, Any]:
    ev = {
        "event": "train",
        "step": step,
        "max_steps": max_steps,
        "loss": 10.0 / step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 1000.0 + step,
        "step_time_s": 0.5,
        "peak_mem_mb": 10.0,
        "world_size": 4,
        "strategy": "fsdp2",
        "time": t,
    }
    ev.update(kw)
    return ev


def write_metrics(run_dir: Path, events: list[dict[str, Any]], torn: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    with open(path, "a") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")
        fh.write(torn)
    return path


def make_checkpoint(
    run_dir: Path, step: int, files: dict[str, int], marker: bool = True, lie: int = 0
) -> Path:
    d = run_dir / "checkpoints" / f"step_{step:08d}"
    for rel, size in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(b"\0" * size)
    d.mkdir(parents=True, exist_ok=True)
    if marker:
        listed = {rel: size + lie for rel, size in files.items()}
        (d / "COMPLETE.json").write_text(
            json.dumps({"step": step, "world_size": 4, "strategy": "fsdp2", "files": listed})
        )
    return d


def marker_path(run_dir: Path, step: int) -> Path:
    """The completion marker of checkpoint ``step`` (its ``COMPLETE.json``)."""
    return run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE.json"


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The run's metrics events of one kind, in order (``train``, ``eval``, ...)."""
    return [e for e in iter_metrics(run_dir) if e.get("event") == kind]


def trains(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``train`` events, in order."""
    return [e for e in iter_metrics(run_dir) if e.get("event") == "train"]


def launcher_pids(run_dir: Path, attempt: int, nodes: int = 2) -> list[str]:
    """Each node's launcher pid in ``attempt`` (``logs/attempt_<A>/node_<N>.pid``): the same in two
    attempts when the launchers were kept and the restart was in place."""
    return [(run_dir / "logs" / f"attempt_{attempt}" / f"node_{n}.pid").read_text() for n in range(nodes)]
