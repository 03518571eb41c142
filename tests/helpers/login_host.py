"""A real login host for the remote tests: Debian's OpenSSH server started by the test, with key
authentication (or passwords only), and the ssh_config, key and known_hosts a laptop uses for it.

On loopback (``address="127.0.0.1"``) or inside a network namespace the test creates on the Slurm
test cluster's bridge (:func:`login_namespace`). The server runs with ``LogLevel DEBUG1`` so the
tests can count the sessions it opened; it is killed by the PID it was started with.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import REPO, kill_tree, poll
from tests.helpers.net import free_port
from tests.helpers.preconditions import require_debian_packages

SSHD = "/usr/sbin/sshd"


@dataclass
class LoginHost:
    alias: str
    address: str
    port: int
    ssh_config: Path
    log: Path
    pid: int

    def sessions(self) -> int:
        """Session channels the server opened so far (one per command a client ran)."""
        if not self.log.exists():
            return 0
        return self.log.read_text(errors="replace").count("ctype session")


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
    return Path(f"{path}.pub").read_text().strip()


@contextmanager
def login_host(
    folder: Path,
    alias: str,
    *,
    address: str = "127.0.0.1",
    port: int | None = None,
    password_only: bool = False,
    netns: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[LoginHost]:
    """sshd on ``address:port`` (in ``netns`` when given); an ssh_config file naming it ``alias``."""
    require_debian_packages("openssh-server")
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port(address if netns is None else "127.0.0.1")
    host_key = folder / "host_ed25519"
    user_key = folder / "id_ed25519"
    host_pub = _keygen(host_key)
    user_pub = _keygen(user_key)
    (folder / "authorized_keys").write_text(user_pub + "\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    setenv = " ".join(f"{k}={v}" for k, v in {"PYTHONPATH": str(REPO), **(env or {})}.items())
    auth = (
        "PasswordAuthentication yes\nPubkeyAuthentication no\nAuthenticationMethods password\n"
        if password_only
        else "PasswordAuthentication no\nPubkeyAuthentication yes\n"
    )
    config = folder / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {host_key}\nPidFile {folder}/sshd.pid\n"
        f"AuthorizedKeysFile {folder}/authorized_keys\nStrictModes no\nUsePAM no\n"
        f"PermitRootLogin yes\nKbdInteractiveAuthentication no\n{auth}"
        f"MaxSessions 200\nMaxStartups 100\nSetEnv {setenv}\nLogLevel DEBUG1\n"
    )
    log = folder / "sshd.log"
    known = folder / "known_hosts"
    known.write_text(f"{address if port == 22 else f'[{address}]:{port}'} {host_pub}\n")
    ssh_config = folder / "ssh_config"
    ssh_config.write_text(
        f"Host {alias}\n  HostName {address}\n  Port {port}\n  User root\n  IdentityFile {user_key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
    )
    cmd = [SSHD, "-D", "-f", str(config), "-E", str(log)]
    if netns is not None:
        cmd = ["nsenter", f"--net=/run/netns/{netns}", *cmd]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    host = LoginHost(alias, address, port, ssh_config, log, proc.pid)
    try:
        poll(
            lambda: (
                "Server listening" in (log.read_text(errors="replace") if log.exists() else "")
                or proc.poll() is not None
            ),
            30,
            "sshd to listen",
        )
        assert proc.poll() is None, log.read_text(errors="replace")
        yield host
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)


@contextmanager
def login_namespace(name: str, address: str, bridge: str = "slbr0") -> Iterator[str]:
    """A network namespace ``name`` with ``address``/24 on ``bridge`` (the cluster's): the login
    host's network. Deleted (with its link) afterwards."""
    veth = f"vlg{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name],
                       check=True, timeout=30)  # fmt: skip
        subprocess.run(["ip", "link", "set", veth, "master", bridge, "up"], check=True, timeout=30)
        subprocess.run(
            ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0"], check=True, timeout=30
        )
        subprocess.run(["ip", "-n", name, "link", "set", "eth0", "up"], check=True, timeout=30)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        yield veth
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)


def laptop_path(folder: Path) -> str:
    """A PATH with ssh, git and this interpreter's folder, and no Slurm command: the laptop's."""
    import shutil
    import sys

    bin_dir = folder / "laptop-bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("ssh", "git"):
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    return f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}"


def close_master(ssh_config: Path, alias: str) -> None:
    subprocess.run(
        ["ssh", "-F", str(ssh_config), "-O", "exit", alias], capture_output=True, timeout=30, check=False
    )
