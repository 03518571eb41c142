"""The channels an event goes out on: a JSON POST to the webhook, the profile's command. One try
each; the owner's courier (:mod:`orchestrator.notify.outbox`) retries, in order, with backoff.

The webhook URL is a secret (a Slack webhook's path is its token): it is read at send time from the
profile's variable or file, only ``http``/``https`` URLs are sent to, and a failure is told by its
kind (``HTTP 500``, ``connection refused``), never with the URL or any part of it.
"""

from __future__ import annotations

import json
import os
import subprocess
from urllib.parse import urlsplit

from orchestrator.notify.events import Event, Target

#: Bound on one HTTP request or one run of the command.
REQUEST_TIMEOUT_S = 10.0
WEBHOOK = "webhook"
COMMAND = "command"


def channels(target: Target) -> list[str]:
    """The channels ``target`` sends on, in the order they are tried."""
    out = []
    if target.webhook_env or target.webhook_file:
        out.append(WEBHOOK)
    if target.command:
        out.append(COMMAND)
    return out


def check_url(url: str) -> str | None:
    """Why ``url`` is not sent to (None: it is), in words that hold nothing of it."""
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "the webhook URL holds a space or a control character (pasted with a line break?)"
    try:
        parts = urlsplit(url)
    except ValueError:
        return "the webhook URL cannot be parsed"
    if parts.scheme.lower() not in ("http", "https"):
        return f"the webhook URL is not http(s) (scheme {parts.scheme.lower()[:10]!r})"
    if not parts.hostname:
        return "the webhook URL names no host"
    return None


def _scrub(text: str, url: str) -> str:
    parts = urlsplit(url)
    for secret in sorted({url, parts.netloc, parts.path, parts.query, parts.fragment}, key=len, reverse=True):
        if secret and secret != "/":
            text = text.replace(secret, "<webhook>")
    return text


def post(url: str, event: Event, timeout: float = REQUEST_TIMEOUT_S) -> str | None:
    """One POST of ``event`` to ``url``: None when the receiver took it, else why not."""
    import urllib.error
    import urllib.request  # here: http.client and ssl cost nothing until there is an event

    bad = check_url(url)
    if bad is not None:
        return bad
    body = json.dumps({"text": event.text}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http(s) checked)
            response.read()
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        text = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        return _scrub(f"{type(reason).__name__}: {text}", url)
    except Exception as exc:  # noqa: BLE001 (any failure is told and retried)
        return _scrub(f"{type(exc).__name__}: {exc}", url)
    return None


def run_command(command: str, event: Event, timeout: float = REQUEST_TIMEOUT_S) -> str | None:
    """One run of the profile's command with the event on stdin and in its environment."""
    env = {
        **os.environ,
        "ORCHESTRATOR_EVENT": event.kind,
        "ORCHESTRATOR_EVENT_TEXT": event.text,
        "ORCHESTRATOR_EVENT_JSON": json.dumps(event.payload()),
    }
    try:
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
    except subprocess.TimeoutExpired:
        return f"no answer in {timeout:.0f} s"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"exit {done.returncode} {last[0][:200]}".strip()
    return None


def deliver(target: Target, event: Event, channel: str) -> str | None:
    """``event`` on ``channel`` of ``target``: None when sent, else why not."""
    if channel == WEBHOOK:
        url, why = target.webhook_url()
        return post(url, event) if url is not None else (why or "no webhook configured")
    if channel == COMMAND and target.command:
        return run_command(target.command, event)
    return f"unknown channel {channel}"
