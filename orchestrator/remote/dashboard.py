"""``ORCHESTRATOR_LOGIN=P orchestrator ui``: the login host's dashboard, opened on this laptop.

The dashboard runs where the registry and the run directories are (the login host), on that host's
loopback and a free port, behind a random token: a login host is shared, and its loopback is every
user's. The laptop forwards its own ``--host:--port`` to it through the connection's master
(``ssh -O forward -L``) and prints the laptop's address with the token. The token travels on the
call's stdin (never on a command line, where the login host's ``ps`` shows it); the same stdin stays
open while the laptop serves, and the agent ends the dashboard when it closes. Ctrl-C here (TERM, a
closed terminal, or the connection dropping) cancels the forward and ends the call: nothing is left running on either side.
"""

from __future__ import annotations

import argparse
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import IO
from urllib.parse import quote

from orchestrator.config.profile.records import ClusterProfile
from orchestrator.contract.errors import UserError
from orchestrator.remote.calls import agent_command, python_failure, run_words
from orchestrator.remote.ssh import SSH_FAILED, Connection, no_prompt

_SERVING = re.compile(r"^orchestrator ui: serving http://127\.0\.0\.1:(\d+)/")
#: The agent's ``run`` option: the first stdin line is the dashboard's token; stdin closing ends it.
HOLD = "--hold"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="orchestrator ui")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--token", default=None)
    parser.add_argument("--refresh", default="5.0")
    return parser.parse_args(list(argv[1:]))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _forward(conn: Connection, op: str, spec: str) -> subprocess.CompletedProcess[str]:
    """``ssh -O forward|cancel -L spec`` on the open master."""
    return subprocess.run(
        ["ssh", *conn.options(), "-O", op, "-L", spec, conn.host],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False, **no_prompt(),
    )  # fmt: skip


def forward_ui(conn: Connection, profile: ClusterProfile, name: str, argv: Sequence[str]) -> int:
    """Serve the login host's dashboard on this laptop's ``--host:--port`` until Ctrl-C."""
    import os

    args = _parse(argv)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: expected 0..65535")
    token = args.token or os.environ.get("ORCHESTRATOR_UI_TOKEN") or secrets.token_urlsafe(24)
    if len(token) < 16:
        raise UserError("--token: use at least 16 characters")
    local_port = args.port or _free_port(args.host)
    words = [*run_words(profile), HOLD, "--", "ui", "--port", "0", "--refresh", str(args.refresh)]

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # a closed terminal or a TERM ends it as Ctrl-C does: cleaned up

    before = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with tempfile.TemporaryFile() as err:
            return _serve(conn, profile, name, args, token, local_port, words, err)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _serve(
    conn: Connection,
    profile: ClusterProfile,
    name: str,
    args: argparse.Namespace,
    token: str,
    local_port: int,
    words: list[str],
    err: IO[bytes],
) -> int:
    def said() -> str:
        err.seek(0)
        return err.read().decode(errors="replace")

    proc = subprocess.Popen(
        conn.argv(agent_command(profile, words)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=err, **no_prompt(),
    )  # fmt: skip
    spec = ""
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.flush()
        remote_port = None
        for raw in proc.stdout:  # the dashboard's first lines; it ended when they end
            found = _SERVING.match(raw.decode(errors="replace"))
            if found:
                remote_port = int(found.group(1))
                break
        if remote_port is None:
            rc = proc.wait()
            if rc == SSH_FAILED:
                raise conn.failure(said())
            failure = python_failure(conn, profile, name, rc, said())
            if failure is not None:
                raise failure
            sys.stderr.write(said() or f"orchestrator ui: the login host's dashboard exited {rc}\n")
            return rc or 1
        bind = f"[{args.host}]" if ":" in args.host else args.host
        spec = f"{bind}:{local_port}:127.0.0.1:{remote_port}"
        opened = _forward(conn, "forward", spec)
        if opened.returncode != 0:
            spec = ""
            last = opened.stderr.strip().splitlines()[-1] if opened.stderr.strip() else "no answer"
            raise UserError(
                f"--host {args.host} --port {local_port}: cannot forward it to {conn.host} ({last})"
            )
        print(
            f"orchestrator ui: serving http://{bind}:{local_port}/?token={quote(token)} (the dashboard of "
            f"{conn.host}, forwarded over ssh; Ctrl-C stops both)",
            flush=True,
        )
        for raw in proc.stdout:  # whatever else it says, until it ends (or Ctrl-C here)
            sys.stdout.write(raw.decode(errors="replace"))
        sys.stderr.write(said())
        return proc.wait()
    finally:
        if spec:
            _forward(conn, "cancel", spec)
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the call: its stdin closes, so the agent stops the dashboard and exits; bounded."""
    if proc.poll() is not None:
        return
    try:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()  # the channel closes with it: the agent sees its stdin end all the same
        proc.wait()
