"""One SSH connection to a login host, reused by every call, never prompting.

Why OpenSSH and not a library (paramiko, asyncssh): the user's ``~/.ssh/config`` (ProxyJump, Match,
IdentityFile, agents, GSSAPI, hardware keys) works only as ssh reads it, and the second factor a
cluster asks for is typed once into ssh itself. Its ControlMaster shares that one authentication
with every later call (``ControlPersist`` keeps it), as NeMo-Run's SSH tunnel does since its PR#583.

Every call runs with ``BatchMode=yes``: ssh never asks for anything. When no master is open, one is
started in batch mode (keys and agents work silently); when the host wants a password or a second
factor that fails at once, and :class:`NeedsLogin` gives the exact ``ssh -fNM ...`` line that
opens the master interactively, after which every call is silent.

The master is started with ``-f`` and its output goes to a file, never a pipe: a persisting master
keeps the stderr it was given, and a reader of that pipe would wait for as long as it lives.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.profile.records import Login
from orchestrator.contract.errors import UserError

#: How long an idle master stays open after its last call.
PERSIST = "8h"
#: ssh's own exit status for its errors (connection, authentication); the command's otherwise.
SSH_FAILED = 255
#: Unix socket paths hold ~107 bytes; ssh adds ``/`` + ``%C`` (40) + a 17-byte temporary suffix.
_SOCKET_PATH_MAX, _SOCKET_NAME_BYTES = 104, 58
_UNREACHABLE_WORDS = ("refused", "timed out", "no route", "resolve", "unreachable", "closed by", "reset by")
_AUTH_WORDS = ("permission denied", "authentication", "password", "keyboard-interactive", "verification code")


def no_prompt() -> dict[str, Any]:
    """How every non-interactive ssh runs: without a terminal (its own session: no /dev/tty to prompt
    on) and without an askpass program. BatchMode covers the destination, but options given on ssh's
    command line do not reach a ProxyJump host's own ssh; without a terminal that one cannot ask either."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "SSH_ASKPASS")}
    env["SSH_ASKPASS_REQUIRE"] = "never"
    return {"start_new_session": True, "env": env}


class NeedsLogin(UserError):
    """The host wants a password or a second factor and no connection is open."""


class Unreachable(UserError):
    """The host did not answer within the connect timeout (or its name did not resolve)."""


def control_dir() -> Path:
    """Where the master's socket lives: the user's runtime dir (private, cleared at logout), else a
    private folder under /tmp. Short: a Unix socket path has ~100 bytes."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "orchestrator-ssh" if runtime else Path("/tmp") / f"orch-ssh-{os.getuid()}"
    if len(str(base)) + _SOCKET_NAME_BYTES > _SOCKET_PATH_MAX:  # ssh: "too long for Unix domain socket"
        base = Path("/tmp") / f"orch-ssh-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if base.stat().st_uid != os.getuid() or base.stat().st_mode & 0o077:
        raise UserError(f"{base}: the SSH control folder must be yours and private (chmod 700 it)")
    return base


@dataclass(frozen=True)
class Connection:
    """How to reach ``login.host``: the ssh options shared by the master and every call."""

    login: Login

    @property
    def host(self) -> str:
        assert self.login.host is not None
        return self.login.host

    def options(self) -> list[str]:
        """Options naming the host's connection (not BatchMode: the user's own master line has none)."""
        opts = ["-o", f"ControlPath={control_dir() / '%C'}"]
        if self.login.ssh_config:
            opts = ["-F", os.path.expanduser(self.login.ssh_config), *opts]
        if self.login.port is not None:
            opts += ["-p", str(self.login.port)]
        if self.login.user:
            opts += ["-l", self.login.user]
        return opts

    def _batch(self) -> list[str]:
        t = self.login.connect_timeout
        return ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={t}", "-o", "ServerAliveInterval=5",
                "-o", "ServerAliveCountMax=2"]  # fmt: skip

    def open_command(self) -> str:
        """The line a user runs once (it may prompt) to open the master every call then reuses."""
        words = ["ssh", "-fNM", *self.options(), "-o", f"ControlPersist={PERSIST}", self.host]
        return shlex.join(words)

    def master_alive(self) -> bool:
        res = subprocess.run(
            ["ssh", *self.options(), "-O", "check", self.host],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False, **no_prompt(),
        )  # fmt: skip
        return res.returncode == 0

    def ensure_master(self) -> None:
        """A master is open afterwards, or :class:`NeedsLogin` / :class:`Unreachable` is raised."""
        if self.master_alive():
            return
        with tempfile.TemporaryFile() as log:  # a file, not a pipe: the master keeps it open
            cmd = [
                "ssh",
                "-fNM",
                *self.options(),
                *self._batch(),
                "-o",
                f"ControlPersist={PERSIST}",
                self.host,
            ]
            res = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                timeout=self.login.connect_timeout + 30, check=False, **no_prompt(),
            )  # fmt: skip
            log.seek(0)
            said = log.read().decode(errors="replace").strip()
        if res.returncode == 0:
            return
        raise self.failure(said)

    def failure(self, said: str) -> UserError:
        """What ssh's own failure means, in one line naming the host."""
        last = said.splitlines()[-1] if said else "no answer"
        if any(word in said.lower() for word in _AUTH_WORDS):
            return NeedsLogin(
                f"login host {self.host} asks for a password or a second factor and no connection is open; "
                f"open one once (it may prompt), then run this again: {self.open_command()}"
            )
        if any(word in said.lower() for word in _UNREACHABLE_WORDS):
            return Unreachable(f"login host {self.host} unreachable ({last})")
        return UserError(f"login host {self.host}: ssh failed ({last})")

    def argv(self, remote_command: str) -> list[str]:
        """``ssh`` running ``remote_command`` (one shell line, every word quoted) through the master."""
        return ["ssh", *self.options(), *self._batch(), "-o", "ControlMaster=no", self.host, remote_command]

    def close(self) -> None:
        """End the master (``ssh -O exit``); nothing when none is open."""
        subprocess.run(
            ["ssh", *self.options(), "-O", "exit", self.host],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False, **no_prompt(),
        )  # fmt: skip
