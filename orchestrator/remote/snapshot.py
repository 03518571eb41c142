"""Sending the code a remote ``submit``/``sweep`` runs: only what changed since the last send.

The files are :mod:`orchestrator.core.snapshot`'s (git's tracked files or the filtered folder, the
size limit, links kept as links and never followed out of the project). The login host keeps a
mirror of the script's folder (``<login.home>/src/<key>``, one per laptop folder); the laptop
asks for the mirror's manifest (one round trip), then sends one tar of the files whose content
differs and the names of those gone, and the same connection call unpacks it and runs the command
with ``--snapshot`` (so later sends never change a queued job): two round trips for a submit.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import tarfile
from pathlib import Path
from typing import IO

from orchestrator.config.profile_records import ClusterProfile
from orchestrator.contract.errors import UserError
from orchestrator.core.snapshot import plan_snapshot
from orchestrator.remote.agent import SYNC_INDEX, file_digest
from orchestrator.remote.calls import agent_command, call, run_words
from orchestrator.remote.ssh import SSH_FAILED, Connection

#: The login host's folder holding the mirrors when the profile names no ``login.home`` there.
MIRRORS = "~/.orchestrator/src"


def mirror_of(source: Path, profile: ClusterProfile) -> str:
    """The login host's mirror of this laptop's ``source`` (``~`` is that host's home)."""
    key = hashlib.sha256(f"{socket.gethostname()}:{source}".encode()).hexdigest()[:16]
    root = f"{profile.login.home.rstrip('/')}/src" if profile.login.home else MIRRORS
    return f"{root}/{key}"


def changes(source: Path, files: tuple[str, ...], remote: dict[str, str]) -> tuple[list[str], list[str]]:
    """(files to send, paths to delete there): content differs / no longer part of the snapshot."""
    local = {name: file_digest(source / name) for name in files}
    send = sorted(n for n, d in local.items() if remote.get(n) != d)
    delete = sorted(n for n in remote if n not in local)
    return send, delete


def pack(source: Path, send: list[str], delete: list[str]) -> bytes:
    """One tar: the deletion index first, then each file or link (``dereference=False``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        index = json.dumps({"delete": delete}).encode()
        info = tarfile.TarInfo(SYNC_INDEX)
        info.size = len(index)
        tar.addfile(info, io.BytesIO(index))
        for name in send:
            tar.add(source / name, arcname=name, recursive=False)
    return buf.getvalue()


def send_and_run(
    conn: Connection, profile: ClusterProfile, argv: list[str], stdout: IO[bytes] | None = None
) -> tuple[int, bytes, str]:
    """Sync the script's folder, then run ``argv`` (``submit``/``sweep``) from the mirror with
    ``--snapshot``: (exit status, stdout unless streamed to ``stdout``, stderr)."""
    if "--" not in argv or argv.index("--") + 1 >= len(argv):
        raise UserError(f"{argv[0]}: no training script: add `-- SCRIPT [ARGS...]` at the end")
    at = argv.index("--") + 1
    snap = plan_snapshot(argv[at])  # the size limit is checked before anything is sent
    mirror = mirror_of(snap.source, profile)
    rc, out, said = call(conn, agent_command(profile, ["manifest", mirror]))
    if rc == SSH_FAILED:
        raise conn.failure(said)
    if rc != 0:
        return rc, out, said
    send, delete = changes(snap.source, snap.files, json.loads(out))
    # the snapshot's folder is the script's: in the mirror the script is its plain name
    remote_argv = [*argv[:at], Path(argv[at]).name, *argv[at + 1 :]]
    if argv[0] == "submit" and "--snapshot" not in argv[:at]:
        remote_argv.insert(1, "--snapshot")
    # a sweep has no --snapshot: its tasks run from a frozen copy of the mirror instead
    words = [*run_words(profile, sync=mirror, freeze=argv[0] == "sweep"), "--", *remote_argv]
    rc, out, said = call(
        conn, agent_command(profile, words), stdin=pack(snap.source, send, delete), stdout=stdout
    )
    if rc == SSH_FAILED:
        raise conn.failure(said)
    return rc, out, said
