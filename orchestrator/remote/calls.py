"""One call to the login host's agent: its command line (every word quoted) and the ssh process.

Why quoting here: ssh hands the remote side one string, which the login host's shell splits again;
each word is :func:`shlex.quote`-d, so job names, paths and script arguments arrive exactly as
typed (``~/`` alone is left to that shell, to mean its home).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from typing import IO

from orchestrator.config.profile.records import ClusterProfile
from orchestrator.contract.errors import UserError
from orchestrator.remote.routing import version
from orchestrator.remote.ssh import SSH_FAILED, Connection, no_prompt

#: A POSIX shell's exit status when it cannot run the command: not executable / not found.
_SHELL_CANNOT_RUN = (126, 127)
#: The version mismatch's fix as every version of the agent words it; the laptop names the profile.
_MISMATCH_FIX = "orchestrator remote install PROFILE"


def _remote_word(path: str) -> str:
    """``path`` as one shell word on the login host, ``~/`` meaning that host's home."""
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def agent_command(profile: ClusterProfile, words: Sequence[str]) -> str:
    """The shell line running the agent with ``words`` on the login host, every word quoted."""
    return " ".join([_remote_word(profile.login.python), "-m", "orchestrator.cli.login_agent",
                     shlex.quote(version()), *map(shlex.quote, words)])  # fmt: skip


def run_words(
    profile: ClusterProfile, *, skip: int = 0, sync: str | None = None, freeze: bool = False
) -> list[str]:
    """The agent's ``run`` options for this profile (login host's home and runs root)."""
    words = ["run"]
    if profile.login.home:
        words += ["--home", profile.login.home]
    if profile.login.runs:
        words += ["--runs", profile.login.runs]
    if skip:
        words += ["--skip", str(skip)]
    if sync:
        words += ["--sync", sync]
    if freeze:
        words += ["--freeze"]
    return words


def call(
    conn: Connection, line: str, *, stdin: bytes | None = None, stdout: IO[bytes] | None = None
) -> tuple[int, bytes, str]:
    """Run ``line`` on the login host: (exit status, stdout unless streamed to ``stdout``, stderr).
    ssh's own failure (255) becomes one line naming the host."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            conn.argv(line), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=err, **no_prompt(),
        )  # fmt: skip
        try:
            out = _exchange(proc, stdin, stdout)
            rc = proc.wait()
        except BaseException:  # Ctrl-C, a closed terminal: ssh (in its own session) goes too
            proc.kill()
            proc.wait()
            raise
        err.seek(0)
        said = err.read().decode(errors="replace")
    return rc, out, said


def _exchange(proc: subprocess.Popen[bytes], stdin: bytes | None, stdout: IO[bytes] | None) -> bytes:
    """Feed ``stdin``, then read ssh's output whole, or stream it to ``stdout`` (b"" then)."""
    out = b""
    if stdin is not None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
    assert proc.stdout is not None
    if stdout is None:
        return proc.stdout.read()
    reader = proc.stdout
    for chunk in iter(lambda: os.read(reader.fileno(), 65536), b""):
        stdout.write(chunk)
        stdout.flush()
    return out


def run_agent(
    conn: Connection,
    profile: ClusterProfile,
    name: str,
    words: Sequence[str],
    *,
    stdin: bytes | None = None,
    stdout: IO[bytes] | None = None,
    ssh_failure: bool = True,
) -> tuple[int, bytes, str]:
    """:func:`call` of the agent with ``words`` for the laptop's profile ``name``. ssh's own failure
    raises one line naming the host (``ssh_failure=False``: returned, for a caller that reconnects);
    a ``login.python`` the login host's shell cannot run (exit 126/127, which the CLI's contract of
    0/1/2 does not have) raises one line naming it and the fix; a version mismatch names the profile."""
    rc, out, said = call(conn, agent_command(profile, words), stdin=stdin, stdout=stdout)
    if rc == SSH_FAILED and ssh_failure:
        raise conn.failure(said)
    failure = python_failure(conn, profile, name, rc, said)
    if failure is not None:
        raise failure
    return rc, out, said.replace(_MISMATCH_FIX, f"orchestrator remote install {shlex.quote(name)}")


def python_failure(
    conn: Connection, profile: ClusterProfile, name: str, rc: int, said: str
) -> UserError | None:
    """The error of a ``login.python`` the login host's shell could not run (exit 126/127); None
    for any other exit status."""
    if rc not in _SHELL_CANNOT_RUN:
        return None
    last = said.strip().splitlines()[-1] if said.strip() else f"exit {rc}"
    return UserError(
        f"profile {name}: login.python {profile.login.python!r} does not run on {conn.host} ({last}); "
        f"run `orchestrator remote install {name}` to put a venv there, or set login.python to "
        "the interpreter of a venv with orchestrator installed"
    )
