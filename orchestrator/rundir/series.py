"""A run's curves (loss, throughput, val loss, resume points), read once and then followed.

``plot`` reads metrics.jsonl once; the dashboard (``orchestrator ui``) asks for the same curves every
few seconds while the run grows. :class:`SeriesFollower` keeps what it parsed and the byte offset it
reached, so a poll parses only the lines appended since (a 100,000-event run is parsed once, not on
every poll). Complete lines are parsed in one ``json.loads`` of a JSON array (one C call instead of
one per line: ~40 % less time); a batch holding a bad line falls back to line by line, which
skips it. :func:`downsample` bounds what is sent to a browser.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import METRICS_FILE


@dataclass
class RunSeries:
    """The curves of one run, sorted by step (the later value wins for a step logged twice)."""

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

    def thinned(self, max_points: int) -> RunSeries:
        """The same curves with at most ``max_points`` points each (:func:`downsample`): what a
        browser is sent of a 100,000-step run."""
        out = RunSeries(resumes=list(self.resumes), strategy=self.strategy, world_size=self.world_size)
        for steps, values in (
            ("train_steps", "train_loss"),
            ("tps_steps", "tokens_per_s"),
            ("sps_steps", "steps_per_s"),
            ("val_steps", "val_loss"),
        ):
            x, y = downsample(getattr(self, steps), getattr(self, values), max_points)
            setattr(out, steps, x)
            setattr(out, values, y)
        return out


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _sorted(points: dict[int, float]) -> tuple[list[int], list[float]]:
    steps = sorted(points)
    return steps, [points[k] for k in steps]


class SeriesFollower:
    """Follows one run's metrics.jsonl: :meth:`update` parses what was appended since the last call.

    After a resume the steps between the checkpoint and the crash are trained (and logged) again;
    the later value wins for each step, so the curve follows the run that actually continued instead
    of doubling back on itself. A file that shrank or was replaced is read again from the start."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self._reset()

    def _reset(self) -> None:
        self._offset = 0
        self._ident: tuple[int, int] | None = None
        self._loss: dict[int, float] = {}
        self._tps: dict[int, float] = {}
        self._sps: dict[int, float] = {}
        self._val: dict[int, float] = {}
        self._resumes: list[tuple[int, str]] = []
        self._strategy: str | None = None
        self._world: int | None = None
        self.events = 0

    def update(self) -> SeriesFollower:
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                if (st.st_dev, st.st_ino) != self._ident or st.st_size < self._offset:
                    self._reset()
                    self._ident = (st.st_dev, st.st_ino)
                if st.st_size == self._offset:
                    return self
                fh.seek(self._offset)
                data = fh.read(st.st_size - self._offset)
        except OSError:
            return self
        end = data.rfind(b"\n") + 1  # a torn last line: the writer is mid-line; read it next time
        if end == 0:
            return self
        self._offset += end
        for event in _parse_lines(data[:end]):
            self._absorb(event)
        return self

    def _absorb(self, e: dict[str, Any]) -> None:
        kind, step = e.get("event"), e.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        self.events += 1
        if kind == "train":
            if _is_num(e.get("loss")):
                self._loss[step] = float(e["loss"])
            if _is_num(e.get("tokens_per_s")):
                self._tps[step] = float(e["tokens_per_s"])
            if _is_num(e.get("step_time_s")) and e["step_time_s"] > 0:
                self._sps[step] = 1.0 / float(e["step_time_s"])
            if isinstance(e.get("strategy"), str):
                self._strategy = e["strategy"]
            if isinstance(e.get("world_size"), int):
                self._world = e["world_size"]
        elif kind == "eval" and _is_num(e.get("val_loss")):
            self._val[step] = float(e["val_loss"])
        elif kind == "resume":
            self._resumes.append((step, str(e.get("checkpoint") or "")))

    def series(self) -> RunSeries:
        s = RunSeries(resumes=list(self._resumes), strategy=self._strategy, world_size=self._world)
        s.train_steps, s.train_loss = _sorted(self._loss)
        s.tps_steps, s.tokens_per_s = _sorted(self._tps)
        s.sps_steps, s.steps_per_s = _sorted(self._sps)
        s.val_steps, s.val_loss = _sorted(self._val)
        return s


def _parse_lines(block: bytes) -> list[dict[str, Any]]:
    lines = [ln for ln in block.split(b"\n") if ln.strip()]
    if not lines:
        return []
    try:
        parsed = json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError:  # a bad line somewhere: parse one by one, skipping it
        parsed = []
        for ln in lines:
            try:
                parsed.append(json.loads(ln))
            except ValueError:
                continue
    return [e for e in parsed if isinstance(e, dict)]


def load_series(run_dir: Path | str) -> RunSeries:
    """The whole run's curves, read once (``plot``)."""
    return SeriesFollower(run_dir).update().series()


def downsample(steps: list[int], values: list[float], max_points: int) -> tuple[list[int], list[float]]:
    """At most ``max_points`` points that keep the curve's shape: each bucket of consecutive points
    gives its first, lowest, highest and last (a loss spike survives, unlike a stride). The first and
    last points are always kept."""
    n = len(steps)
    if n <= max_points or max_points < 8:
        return list(steps), list(values)
    buckets = max_points // 4
    size = n / buckets
    keep: list[int] = []
    for b in range(buckets):
        lo, hi = int(b * size), min(int((b + 1) * size), n)
        if lo >= hi:
            continue
        chunk = values[lo:hi]
        i_min = lo + min(range(len(chunk)), key=chunk.__getitem__)
        i_max = lo + max(range(len(chunk)), key=chunk.__getitem__)
        keep.extend(sorted({lo, i_min, i_max, hi - 1}))
    return [steps[i] for i in keep], [values[i] for i in keep]
