"""A run's notifications, durable and in order: the owner records each event, then delivers them.

Inside ``<run_dir>/notify/``::

    events/<key>.json     one recorded event: {"seq", "recorded", "event": payload}; made with O_EXCL
    sent/<key>.<channel>  delivered on that channel (webhook, command): never sent there again
    notify.log            one line per try and per give-up, never the URL
    courier.lock          held (flock) while one event is tried on one channel

Only the run's owner (its supervising process: the Slurm batch step, a local job's node 0) writes
here; ``status``, ``wait`` and the dashboard only read. An event is recorded before it is sent, so a
receiver that is down, or an owner that dies mid-try, loses nothing: the owner retries with backoff
while it lives, and the next owner of the run (the next attempt, a resumed job) delivers what is left
first. Delivery is in record order, the head first: a later event never overtakes an earlier one. A
crash between a receiver's answer and the ``sent`` marker can repeat that one event (at least once).

Files are 0600 whatever the run's sharing: the events name the run and its failures, and only the
owner reads them back.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.run_dir import NOTIFY_DIR

#: The sending log inside ``notify/``: one line per try, never the URL.
LOG_NAME = "notify.log"
LOCK_NAME = "courier.lock"
EVENTS_DIR = "events"
SENT_DIR = "sent"
#: First pause after a failed try; doubled after each, up to :data:`MOST_BACKOFF_S`.
FIRST_BACKOFF_S = 0.5
MOST_BACKOFF_S = 30.0
FILE_MODE = 0o600
DIR_MODE = 0o700


@dataclass(frozen=True)
class Recorded:
    """An event as the outbox holds it."""

    key: str
    seq: int
    payload: dict[str, Any]


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / NOTIFY_DIR


def log(run_dir: Path, line: str) -> None:
    """A line in ``notify.log`` (0600); a run directory that cannot take it loses only the line."""
    try:
        fd = os.open(folder(run_dir) / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {os.uname().nodename} {line}\n")
    except OSError:
        pass


def _safe_key(key: str) -> bool:
    return bool(key) and "/" not in key and not key.startswith(".") and "\0" not in key


def recorded(run_dir: Path) -> list[Recorded]:
    """Every recorded event, in record order."""
    out = []
    for path in (folder(run_dir) / EVENTS_DIR).glob("*.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # being written (O_EXCL then write): the next look finds it whole
        if isinstance(data, dict) and isinstance(data.get("event"), dict):
            out.append(Recorded(path.stem, int(data.get("seq") or 0), data["event"]))
    return sorted(out, key=lambda r: (r.seq, r.key))


def record(run_dir: Path, key: str, payload: dict[str, Any]) -> bool:
    """Record an event once (True the first time its key is recorded). Needs ``notify/``."""
    if not _safe_key(key):
        raise ValueError(f"not an event key: {key!r}")
    events = folder(run_dir) / EVENTS_DIR
    events.mkdir(mode=DIR_MODE, exist_ok=True)
    path = events / f"{key}.json"
    if path.exists():
        return False
    seq = len(list(events.glob("*.json"))) + 1
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({"seq": seq, "recorded": time.time(), "event": payload}, fh)
    return True


def is_sent(run_dir: Path, key: str, channel: str) -> bool:
    return (folder(run_dir) / SENT_DIR / f"{key}.{channel}").exists()


def mark_sent(run_dir: Path, key: str, channel: str) -> None:
    sent = folder(run_dir) / SENT_DIR
    sent.mkdir(mode=DIR_MODE, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(sent / f"{key}.{channel}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))


def pending(run_dir: Path, channels: list[str]) -> list[Recorded]:
    """Recorded events not yet sent on every channel, in order."""
    return [r for r in recorded(run_dir) if any(not is_sent(run_dir, r.key, c) for c in channels)]


@contextlib.contextmanager
def _courier_lock(run_dir: Path) -> Iterator[None]:
    """One try at a time across the run's owners (a finishing owner still draining while the next
    attempt's owner starts): ``flock`` on ``notify/courier.lock``."""
    import fcntl

    fd = os.open(folder(run_dir) / LOCK_NAME, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Courier:
    """The owner's sending thread: delivers the outbox head first, retrying with backoff while the
    owner lives. ``deliver(recorded, channel)`` returns None when sent, else why not (one line, no
    secret)."""

    def __init__(self, run_dir: Path, channels: list[str], deliver: Any) -> None:
        self.run_dir, self.channels, self.deliver = Path(run_dir), channels, deliver
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="notify-courier", daemon=True)

    def start(self) -> Courier:
        self._thread.start()
        return self

    def wake(self) -> None:
        """New events were recorded."""
        self._idle.clear()
        self._wake.set()

    def _loop(self) -> None:
        pause = FIRST_BACKOFF_S
        tries: dict[tuple[str, str], int] = {}
        while not self._stop.is_set():
            self._wake.clear()
            left = pending(self.run_dir, self.channels)
            if not left:
                self._idle.set()
                self._wake.wait()
                continue
            head = left[0]
            failed = None
            for channel in self.channels:
                with _courier_lock(self.run_dir):
                    # Under the lock: an owner still draining beside a new one sends nothing twice.
                    if is_sent(self.run_dir, head.key, channel):
                        continue
                    n = tries[(head.key, channel)] = tries.get((head.key, channel), 0) + 1
                    why = self.deliver(head, channel)
                    if why is None:
                        mark_sent(self.run_dir, head.key, channel)
                        log(self.run_dir, f"{head.key}: {channel} sent ({n} {'try' if n == 1 else 'tries'})")
                if why is not None:
                    failed = f"{head.key}: {channel} try {n} failed ({why}); retrying in {pause:.1f} s"
                    break
            if failed is None:
                pause = FIRST_BACKOFF_S
                continue
            log(self.run_dir, failed)
            self._stop.wait(pause)
            pause = min(pause * 2, MOST_BACKOFF_S)

    def drain(self, timeout_s: float) -> list[str]:
        """Wait, at most ``timeout_s``, until nothing is pending; then stop. The keys left unsent."""
        self.wake()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            idle = self._idle.wait(max(0.0, min(0.5, deadline - time.monotonic())))
            if idle and not pending(self.run_dir, self.channels):
                break
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        left = [r.key for r in pending(self.run_dir, self.channels)]
        if left:
            log(
                self.run_dir,
                f"left unsent at this owner's end (the next owner sends them): {', '.join(left)}",
            )
        return left
