"""Sending the code a remote ``submit``/``sweep`` runs: only what changed since the last send.

The files are :mod:`orchestrator.runner.snapshot`'s (git's tracked files or the filtered folder, the
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
import os
import shutil
import socket
import tarfile
from pathlib import Path
from typing import IO, BinaryIO

from orchestrator.config.profile.records import ClusterProfile
from orchestrator.contract.errors import UserError
from orchestrator.remote.calls import run_agent, run_words
from orchestrator.remote.ssh import Connection
from orchestrator.runner.snapshot import plan_snapshot

#: The run-directory files a plot is drawn from (``fetch``).
PLOT_FILES = ("job.json", "metrics.jsonl")
#: First member of a sync tar: ``{"delete": [paths]}``.
SYNC_INDEX = ".orchestrator-sync.json"


def file_digest(path: Path) -> str:
    """A regular file's sha256, or ``link:<target>`` for a symbolic link (never followed)."""
    if path.is_symlink():
        return "link:" + os.readlink(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(folder: Path) -> dict[str, str]:
    """relative path -> digest of every file and link under ``folder`` (links are not entered)."""
    out: dict[str, str] = {}
    if not folder.is_dir():
        return out
    for here, dirs, files in os.walk(folder, followlinks=False):
        base = Path(here)
        for name in [*files, *(d for d in dirs if (base / d).is_symlink())]:
            out[str((base / name).relative_to(folder))] = file_digest(base / name)
    return out


def _inside(folder: Path, rel: str) -> Path:
    target = Path(os.path.normpath(folder / rel))
    if target == folder or folder not in target.parents:
        raise SystemExit(f"orchestrator agent: refusing {rel!r}: outside {folder}")
    return target


def receive(folder: Path, stream: BinaryIO) -> None:
    """Unpack the laptop's tar into ``folder``: deletions first, then the changed files. Members
    may not leave the folder; links are kept as links (the ``tar`` filter)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if member.name == SYNC_INDEX:
                data = tar.extractfile(member)
                index = json.loads(data.read()) if data else {}
                for rel in index.get("delete", []):
                    target = _inside(folder, rel)
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target)
                    elif target.exists() or target.is_symlink():
                        target.unlink()
                continue
            target = _inside(folder, member.name)
            if target.is_symlink() or target.is_file():
                target.unlink()  # a file that became a link, or the reverse
            tar.extract(member, folder, filter="tar")


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
    conn: Connection, profile: ClusterProfile, name: str, argv: list[str], stdout: IO[bytes] | None = None
) -> tuple[int, bytes, str]:
    """Sync the script's folder, then run ``argv`` (``submit``/``sweep``) from the mirror with
    ``--snapshot``: (exit status, stdout unless streamed to ``stdout``, stderr)."""
    if "--" not in argv or argv.index("--") + 1 >= len(argv):
        raise UserError(f"{argv[0]}: no training script: add `-- SCRIPT [ARGS...]` at the end")
    at = argv.index("--") + 1
    snap = plan_snapshot(argv[at])  # the size limit is checked before anything is sent
    mirror = mirror_of(snap.source, profile)
    rc, out, said = run_agent(conn, profile, name, ["manifest", mirror])
    if rc != 0:
        return rc, out, said
    send, delete = changes(snap.source, snap.files, json.loads(out))
    # the mirror is the snapshot's folder (the script's, or the one holding its package): the script
    # is where it is in that folder (``train/train.py``), never flattened
    remote_argv = [*argv[:at], snap.script, *argv[at + 1 :]]
    if argv[0] == "submit" and "--snapshot" not in argv[:at]:
        remote_argv.insert(1, "--snapshot")
    # a sweep has no --snapshot: its tasks run from a frozen copy of the mirror instead
    words = [*run_words(profile, sync=mirror, freeze=argv[0] == "sweep"), "--", *remote_argv]
    return run_agent(conn, profile, name, words, stdin=pack(snap.source, send, delete), stdout=stdout)
