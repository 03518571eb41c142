"""Metrics: ``<run_dir>/metrics.jsonl`` (rank 0), TensorBoard via Accelerate trackers, progress output.

The JSON-lines schema is a contract with the monitoring code; every line is
flushed as written:

* ``{"event":"train","step","max_steps","loss","lr","grad_norm","tokens_per_s","step_time_s",
  "peak_mem_mb","world_size","strategy","time"}``
* ``{"event":"eval","step","val_loss","time"}``
* ``{"event":"resume","step","checkpoint","time"}``
* ``{"event":"startup","process","imports","process_group","model","time"}``: wall clock of rank 0's
  interpreter start and of the ends of its imports, ``Accelerator()`` (process group) and model
  build + ``prepare`` (``process`` is None where ``/proc`` is missing)
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator


def peak_mem_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def process_start_time() -> float | None:
    """Wall clock at which this process started (Linux ``/proc``), None elsewhere: the interpreter's
    own start-up and imports precede any stamp the script can take itself."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        # Boot time from the uptime (10 ms resolution), not /proc/stat's btime (whole seconds).
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class Metrics:
    """Writes only on the main process; every method is a no-op elsewhere."""

    def __init__(
        self,
        accelerator: Accelerator,
        run_dir: Path,
        max_steps: int,
        world_size: int,
        strategy: str,
        log_every: int,
    ) -> None:
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.max_steps = max_steps
        self.world_size = world_size
        self.strategy = strategy
        self.log_every = max(1, log_every)
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.first_step: int | None = None
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") if self.main else None  # noqa: SIM115

    def _write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def train(
        self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, step_time: float
    ) -> None:
        if self.first_step is None:
            self.first_step = step
            self.started = time.monotonic() - step_time
        tokens_per_s = float(tokens / step_time) if step_time > 0 else 0.0
        record = {
            "event": "train",
            "step": int(step),
            "max_steps": int(self.max_steps),
            "loss": float(loss),
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "step_time_s": float(step_time),
            "peak_mem_mb": float(peak_mem_mb()),
            "world_size": int(self.world_size),
            "strategy": self.strategy,
            "time": time.time(),
        }
        self._write(record)
        if self.main and (step % self.log_every == 0 or step == self.max_steps):
            # Trackers get every --log-every'th step (metrics.jsonl keeps them all): Accelerate's
            # TensorBoard tracker flushes its file at every log() call, which made most of the step
            # boundary's cost (bench/bench_step_boundary.py).
            self.accelerator.log(
                {
                    "train/loss": loss,
                    "train/lr": lr,
                    "train/grad_norm": grad_norm,
                    "train/tokens_per_s": tokens_per_s,
                },
                step=step,
            )
        if self.main:
            self._progress(step, loss, tokens_per_s)

    def eval(self, step: int, val_loss: float) -> None:
        self._write({"event": "eval", "step": int(step), "val_loss": float(val_loss), "time": time.time()})
        if self.main:
            self.accelerator.log({"eval/val_loss": val_loss}, step=step)
            self.say(f"eval step {step}: val_loss {val_loss:.4f}")

    def resume(self, step: int, checkpoint: str) -> None:
        self._write(
            {"event": "resume", "step": int(step), "checkpoint": str(checkpoint), "time": time.time()}
        )

    def startup(self, stamps: dict[str, float | None]) -> None:
        self._write({"event": "startup", **stamps, "time": time.time()})

    def _progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        done = step - (self.first_step or step) + 1
        elapsed = time.monotonic() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.max_steps - step) / rate if rate > 0 else 0.0
        if self.tty:
            width = 30
            filled = int(width * step / max(1, self.max_steps))
            bar = "#" * filled + "-" * (width - filled)
            end = "\n" if step >= self.max_steps else ""
            print(
                f"\r[{bar}] {step}/{self.max_steps} loss {loss:.4f} {rate:.1f} step/s ETA {_fmt_duration(eta)}",
                end=end,
                file=sys.stderr,
                flush=True,
            )
        elif step % self.log_every == 0 or step == self.max_steps:
            print(
                f"step {step}/{self.max_steps} loss {loss:.4f} {rate:.2f} steps/s {tokens_per_s:.0f} tok/s "
                f"ETA {_fmt_duration(eta)}",
                flush=True,
            )

    def say(self, line: str) -> None:
        if self.main:
            if self.tty:
                print("\r", end="", file=sys.stderr)
            print(line, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
