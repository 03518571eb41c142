"""What ``status`` shows for a run, read from its run directory cheaply and without torch.

``status`` polls many run directories every few seconds, so :func:`summarize` reads only the tail
of ``metrics.jsonl`` (seeking from the end) and never parses the whole file, and
:class:`SummaryCache` skips runs whose files did not change. File names and the checkpoint rule
come from the run-directory contract, :mod:`orchestrator.contract.run_dir`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import (
    METRICS_FILE,
    CheckpointInfo,
    attempt_dirs,
    corrupt_checkpoints,
    last_complete_checkpoint,
    read_job_json,
)

#: How much of metrics.jsonl ``summarize`` reads at first; doubled (up to the cap) only when the
#: window holds no train event, e.g. right after a burst of eval lines.
TAIL_BYTES = 256 * 1024
TAIL_BYTES_CAP = 8 * 1024 * 1024
#: Train events used for the ETA: recent enough to follow a slowdown, many enough to smooth noise.
ETA_WINDOW = 50


def iter_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every complete event in metrics.jsonl, streamed (for plots; ``status`` uses the tail)."""
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # torn last line: the writer is mid-line
                event = _parse_event(raw)
                if event is not None:
                    yield event
    except OSError:
        return


def _parse_event(raw: bytes) -> dict[str, Any] | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        event = json.loads(raw)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


# ---------------------------------------------------------------------------- resume counting
_RESUME_NEEDLE = b'"resume"'
# (device, inode) -> (bytes scanned, resume events seen): `status --watch` rescans only new bytes.
_resume_cache: dict[tuple[int, int], tuple[int, int]] = {}
#: Keys counted by this process: what :class:`SummaryCache` carries over to the next ``status``, so
#: a live run's file is scanned once, then only its new bytes, not whole on every call.
_resume_touched: set[tuple[int, int]] = set()


def count_resumes(run_dir: Path) -> int:
    """Number of resume events in metrics.jsonl.

    A resume happens at most once per attempt, so the count is a whole-file property that a tail
    window cannot give. Rather than JSON-parse the file, count the ``"resume"`` token in complete
    lines with a byte search, and remember how far we got (per inode) so repeated polls only read
    what was appended.
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        st = path.stat()
    except OSError:
        return 0
    key = (st.st_dev, st.st_ino)
    _resume_touched.add(key)
    done, count = _resume_cache.get(key, (0, 0))
    if st.st_size < done:  # truncated / rewritten: start over
        done, count = 0, 0
    if st.st_size == done:
        return count
    try:
        with open(path, "rb") as fh:
            fh.seek(done)
            carry = b""
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    break
                data = carry + chunk
                cut = data.rfind(b"\n") + 1
                complete, carry = data[:cut], data[cut:]
                if _RESUME_NEEDLE in complete:  # rare: split and parse only such chunks
                    count += sum(
                        1 for ln in complete.split(b"\n") if _RESUME_NEEDLE in ln and _is_resume_line(ln)
                    )
                done += len(complete)
    except OSError:
        return count
    _resume_cache[key] = (done, count)
    return count


def _is_resume_line(line: bytes) -> bool:
    event = _parse_event(line)
    return event is not None and event.get("event") == "resume"


# ---------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class RunSummary:
    """What ``status`` shows for one run; every field may be None before the first event."""

    run_dir: Path
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    val_step: int | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    world_size: int | None = None
    strategy: str | None = None
    peak_mem_mb: float | None = None
    last_event_time: float | None = None
    checkpoint: CheckpointInfo | None = None
    resumes: int = 0
    attempts: int = 0
    corrupt_checkpoints: list[int] = field(default_factory=list)
    """Steps of checkpoints a restore found corrupt (CORRUPT.json) and skipped, newest first."""
    budget: str | None = None
    """The run's ``--budget`` (job.json), None without one."""
    budget_spent: float | None = None
    """What the run has spent of it, in its unit: every attempt's meter (``budget.json``)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        if self.checkpoint is not None:
            data["checkpoint"] = {**asdict(self.checkpoint), "path": str(self.checkpoint.path)}
        return data


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _int(value: Any) -> int | None:
    """A count from an event (step, max_steps, world size): a non-negative int, else None (not
    shown). A script's ``"step": -7`` was shown as STEP -7."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def estimate_seconds_per_step(train_events: list[dict[str, Any]]) -> float | None:
    """Wall-clock seconds per step over the recent train events of the current attempt.

    Uses the slope of (time, step) so eval and checkpoint pauses are included (an ETA that ignores
    them is optimistic); falls back to the median ``step_time_s`` when there is only one point.
    """
    window = train_events[-ETA_WINDOW:]
    pts = [(_num(e.get("time")), _int(e.get("step"))) for e in window]
    good = [(t, s) for t, s in pts if t is not None and s is not None]
    if len(good) >= 2:
        (t0, s0), (t1, s1) = good[0], good[-1]
        if s1 > s0 and t1 >= t0:
            return (t1 - t0) / (s1 - s0)
    times = [x for x in (_num(e.get("step_time_s")) for e in window) if x is not None and x >= 0]
    if not times:
        return None
    import statistics  # here: it pulls in fractions and decimal, ~5 ms of every `status` start

    return statistics.median(times)


def iter_lines_reversed(path: Path, max_bytes: int, chunk: int = 32 * 1024) -> Iterator[bytes]:
    """Complete lines of a file, newest first, reading backwards from the end in chunks.

    Reads at most ``max_bytes``; a torn last line (no newline yet) is skipped, and the cut line
    at the window's start is not yielded. A consumer that stops early reads only what it used.
    """
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        limit = max(0, end - max_bytes)
        pos = end
        buf = b""
        torn_dropped = False
        while pos > limit:
            step = min(chunk, pos - limit)
            pos -= step
            fh.seek(pos)
            buf = fh.read(step) + buf
            if not torn_dropped:
                nl = buf.rfind(b"\n")
                if nl < 0:
                    continue
                buf = buf[: nl + 1]
                torn_dropped = True
            first_nl = buf.find(b"\n")
            complete, buf = buf[first_nl + 1 :], buf[: first_nl + 1]
            if complete:
                yield from reversed(complete[:-1].split(b"\n"))
        if pos == 0 and torn_dropped and buf:
            yield buf[:-1]


def _train_window_ends(window_newest_first: list[bytes]) -> list[dict[str, Any]]:
    """Parse only the newest and the oldest train event of the ETA window (the slope needs no more)."""
    newest = next(
        (e for e in map(_parse_event, window_newest_first) if e and e.get("event") == "train"), None
    )
    if newest is None:
        return []
    oldest = next(
        (e for e in map(_parse_event, reversed(window_newest_first)) if e and e.get("event") == "train"), None
    )
    if oldest is None or oldest is newest or oldest.get("step") == newest.get("step"):
        return [newest]
    return [oldest, newest]


def summarize(run_dir: Path | str, tail_bytes: int = TAIL_BYTES) -> RunSummary:
    """Summarise a run from job.json, the tail of metrics.jsonl, checkpoints and log folders.

    metrics.jsonl is read backwards and only a few lines are JSON-parsed: the newest and the
    ``ETA_WINDOW``-th newest train event of the current attempt (the ETA is the wall-clock slope
    between them), the newest eval (searched within ``tail_bytes``) and the newest resume. A
    byte-substring test classifies the other lines without parsing, so ``status`` over 1,000 runs
    costs a handful of parses per run, not thousands.
    """
    run_dir = Path(run_dir)
    job = read_job_json(run_dir)
    train_raw: list[bytes] = []  # newest first, parsed lazily (only the window's ends are needed)
    train_before_resume: int | None = None  # how many of them are newer than the newest resume
    resume: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    last_time: float | None = None
    seen = 0
    try:
        for raw in iter_lines_reversed(run_dir / METRICS_FILE, TAIL_BYTES_CAP):
            seen += len(raw) + 1
            want_train = len(train_raw) < ETA_WINDOW and not train_before_resume
            if want_train and b'"train"' in raw:
                train_raw.append(raw)
            if last_time is None:
                event = _parse_event(raw)
                last_time = _num(event.get("time")) if event else None
            if last_eval is None and seen <= tail_bytes and b'"eval"' in raw:
                event = _parse_event(raw)
                if event and event.get("event") == "eval" and _num(event.get("val_loss")) is not None:
                    last_eval = event
            if resume is None and b'"resume"' in raw:
                event = _parse_event(raw)
                if event and event.get("event") == "resume":
                    resume = event
                    train_before_resume = len(train_raw)
            enough_train = len(train_raw) >= ETA_WINDOW or bool(train_before_resume)
            if enough_train and (last_eval is not None or seen > tail_bytes):
                break
    except OSError:
        pass
    # Only the current attempt's train events estimate speed: across a resume the clock jumps.
    window = train_raw[:train_before_resume] if train_before_resume else train_raw
    train = _train_window_ends(window)  # oldest .. newest (at most two events, or one)

    last = train[-1] if train else {}
    step = _int(last.get("step"))
    if step is None and resume is not None:
        step = _int(resume.get("step"))
    max_steps = _int(last.get("max_steps")) or _int(job.get("max_steps"))
    sec_per_step = estimate_seconds_per_step(train)
    eta: float | None = None
    if step is not None and max_steps is not None and sec_per_step is not None:
        eta = max(0, max_steps - step) * sec_per_step

    world_size = _int(last.get("world_size"))
    if world_size is None and _int(job.get("nodes")) and _int(job.get("procs_per_node")):
        world_size = int(job["nodes"]) * int(job["procs_per_node"])
    strategy = last.get("strategy") if isinstance(last.get("strategy"), str) else job.get("strategy")
    return RunSummary(
        run_dir=run_dir,
        step=step,
        max_steps=max_steps,
        loss=_num(last.get("loss")),
        val_loss=_num(last_eval.get("val_loss")) if last_eval else None,
        val_step=_int(last_eval.get("step")) if last_eval else None,
        lr=_num(last.get("lr")),
        tokens_per_s=_num(last.get("tokens_per_s")),
        step_time_s=_num(last.get("step_time_s")),
        eta_s=eta,
        world_size=world_size,
        strategy=strategy if isinstance(strategy, str) else None,
        peak_mem_mb=_num(last.get("peak_mem_mb")),
        last_event_time=last_time,
        checkpoint=last_complete_checkpoint(run_dir),
        corrupt_checkpoints=[step for step, _ in corrupt_checkpoints(run_dir)],
        resumes=count_resumes(run_dir),
        attempts=len(attempt_dirs(run_dir)),
        **_budget_spent(run_dir, job),
    )


def _budget_spent(run_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    """``budget`` and ``budget_spent`` of a run with a budget (its meters: orchestrator.contract.budget_records)."""
    from orchestrator.config.budget import parse_budget
    from orchestrator.contract.budget_records import spent_hours
    from orchestrator.contract.errors import UserError

    text = job.get("budget")
    if not isinstance(text, str):
        return {}
    try:
        budget = parse_budget(text)
    except UserError:
        return {}
    spent = spent_hours(run_dir)
    if budget.is_money:
        raw = job.get("profile")
        profile: dict[str, Any] = raw if isinstance(raw, dict) else {}
        key = "price_per_gpu_hour" if _int(profile.get("gpus_per_node")) else "price_per_cpu_hour"
        spent *= _num(profile.get(key)) or 0.0
    return {"budget": str(budget), "budget_spent": spent}
