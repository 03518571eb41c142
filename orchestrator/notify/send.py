"""Sending a claimed event: a JSON POST to the webhook and/or the profile's command, retried with
backoff within the target's ``timeout_s``, in threads, so that a failed notification never fails or
delays a job. Which events exist and who may send one: :mod:`orchestrator.notify.events`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from orchestrator.notify.events import Event, Target, claim, log

#: First pause between tries; doubled after each failed one.
FIRST_BACKOFF_S = 0.5
#: Bound on one HTTP request (within the target's ``timeout_s``).
REQUEST_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------------- sending
def _scrub(text: str, secret: str | None) -> str:
    return text.replace(secret, "<webhook>") if secret else text


def _post(url: str, event: Event, timeout: float) -> None:
    import urllib.request  # here: http.client and ssl are no cost of ``status`` without events

    body = json.dumps({"text": event.text}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (the user's URL)
        response.read()


def _run_command(command: str, event: Event, timeout: float) -> None:
    import subprocess

    env = {
        **os.environ,
        "ORCHESTRATOR_EVENT": event.kind,
        "ORCHESTRATOR_EVENT_TEXT": event.text,
        "ORCHESTRATOR_EVENT_JSON": json.dumps(event.payload()),
    }
    done = subprocess.run(
        command,
        shell=True,
        input=json.dumps(event.payload()).encode(),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"exit {done.returncode} {last[0][:200]}".strip())


def _with_retries(
    what: str, act: Callable[[float], None], deadline: float, run_dir: Path, event: Event, secret: str | None
) -> bool:
    pause, tries = FIRST_BACKOFF_S, 0
    while True:
        tries += 1
        left = deadline - time.monotonic()
        try:
            act(max(0.1, min(REQUEST_TIMEOUT_S, left)))
        except Exception as exc:  # noqa: BLE001 (any failure is retried, then logged)
            why = _scrub(f"{type(exc).__name__}: {exc}", secret)
            left = deadline - time.monotonic()
            if left <= pause:
                log(run_dir, f"{event.key}: {what} FAILED after {tries} tries: {why}")
                return False
            log(run_dir, f"{event.key}: {what} try {tries} failed ({why}); retrying in {pause:.1f} s")
            time.sleep(pause)
            pause *= 2
            continue
        log(run_dir, f"{event.key}: {what} sent ({tries} {'try' if tries == 1 else 'tries'})")
        return True


def send(run_dir: Path, target: Target, event: Event) -> bool:
    """Send one claimed event to every channel of ``target``, retrying within ``timeout_s``."""
    deadline = time.monotonic() + target.timeout_s
    ok = True
    if target.webhook_env or target.webhook_file:
        url, why = target.webhook_url()
        if url is None:
            log(run_dir, f"{event.key}: webhook not sent: {why}")
            ok = False
        else:
            ok = _with_retries("webhook", lambda t: _post(url, event, t), deadline, run_dir, event, url)
    if target.command:
        cmd = target.command
        ok = (
            _with_retries("command", lambda t: _run_command(cmd, event, t), deadline, run_dir, event, None)
            and ok
        )
    return ok


def notify(
    run_dir: Path, events: Iterable[Event], target: Target | None = None, daemon: bool = False
) -> list[threading.Thread]:
    """Claim each event and send the ones claimed here, each from its own thread (returned, started).
    ``daemon=False`` (the login host's commands): the process outlives its output until they end,
    within ``timeout_s``; the batch step passes True and joins them for a bounded time."""
    threads: list[threading.Thread] = []
    events = list(events)
    if not events:
        return threads
    target = target or Target.of_run(run_dir)
    if target is None:
        return threads
    for event in events:
        if claim(run_dir, event):
            thread = threading.Thread(
                target=send, args=(run_dir, target, event), name=f"notify-{event.key}", daemon=daemon
            )
            thread.start()
            threads.append(thread)
    return threads


def join(threads: Iterable[threading.Thread], timeout_s: float) -> None:
    """Wait for senders, at most ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
