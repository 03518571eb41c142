"""The laptop's side: which commands go to a login host, and carrying each one there.

Which commands go there: :mod:`.routing`. A routed command is the login host's own command line
(``agent run -- ARGS``), so its checks, output and exit codes are the same as there. What the laptop adds: the script's folder is synced
first (:mod:`.snapshot`) and the job runs from a ``--snapshot`` of it; ``status --json`` serves
ended jobs from the book; ``logs`` reconnects after a dropped connection and continues where it was
cut (``logs -f``: at each file's offset).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from orchestrator.config.profile.records import ClusterProfile
from orchestrator.contract.errors import UserError
from orchestrator.remote import book
from orchestrator.remote.book import Target
from orchestrator.remote.calls import run_agent, run_words
from orchestrator.remote.routing import load_login, profile_word_index
from orchestrator.remote.ssh import SSH_FAILED, Connection

#: How long ``logs`` keeps trying to reconnect after its connection dropped.
RECONNECT_S = 120.0


def _connect(target: Target) -> tuple[ClusterProfile, Connection]:
    """The target's profile (from the folder it was loaded from; what is wrong with it, named) and
    an open master to its login host."""
    profile = load_login(target)
    conn = Connection(profile.login)
    conn.ensure_master()  # fails here, at once, when the host would ask for something
    return profile, conn


class _Tee:
    """Output streamed to this terminal as it comes, and kept (the first MiB) to read job ids from."""

    def __init__(self) -> None:
        self.kept = bytearray()

    def write(self, data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        if len(self.kept) < 1 << 20:
            self.kept += data

    def flush(self) -> None:
        sys.stdout.buffer.flush()


def run_captured(target: Target, argv: Sequence[str], stream: bool = False) -> tuple[int, str, str]:
    """Run ``argv`` on the login host of ``target``: (exit status, stdout, stderr); ``stream``:
    stdout is also printed as it comes (``submit --wait``, ``resume --wait``). A submit, sweep or
    resume sends the code first (submit, sweep) and books the job ids it printed."""
    profile, conn = _connect(target)
    words = _remote_argv(profile, target.name, list(argv))
    tee = _Tee() if stream else None
    sink: IO[bytes] | None = tee  # type: ignore[assignment]
    if words[0] in ("submit", "sweep"):
        from orchestrator.remote.sync import send_and_run

        rc, out, said = send_and_run(conn, profile, target.name, words, stdout=sink)
    else:
        rc, out, said = run_agent(
            conn, profile, target.name, [*run_words(profile), "--", *words], stdout=sink
        )
    text = (bytes(tee.kept) if tee is not None else out).decode(errors="replace")
    if words[0] in ("submit", "sweep", "resume"):
        book.remember(target, _submitted_ids(text))
    return rc, text, said


def forward(target: Target, argv: Sequence[str]) -> int:
    """Run the command line ``argv`` on the login host of ``target``; print here."""
    command = argv[0]
    if command in ("submit", "sweep", "resume"):
        rc, _, said = run_captured(target, argv, stream=True)
        sys.stderr.write(said)
        return rc
    profile, conn = _connect(target)
    argv = _remote_argv(profile, target.name, list(argv))
    if command == "status" and "--json" in argv and "--watch" not in argv:
        return _status_json(conn, profile, target, argv)
    if command == "logs":
        return _logs(conn, profile, target.name, argv)
    if command == "plot":
        return _plot(conn, profile, target.name, argv)
    if command == "ui":  # the login host's dashboard, forwarded here
        from orchestrator.remote.dashboard import forward_ui

        return forward_ui(conn, profile, target.name, argv)
    rc, _, said = run_agent(
        conn, profile, target.name, [*run_words(profile), "--", *argv], stdout=sys.stdout.buffer
    )
    sys.stderr.write(said)
    return rc


def _remote_argv(profile: ClusterProfile, name: str, argv: list[str]) -> list[str]:
    """Profile names as the login host knows them (``login.profile``); no laptop profile folder."""
    there = profile.login.profile or name
    out, skip = [], False
    cut = argv.index("--") if "--" in argv else len(argv)
    named_at = profile_word_index(argv)  # `doctor PROFILE`
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if i == named_at and word == name:
            word = there
        if i < cut and word == "--profiles-dir":
            skip = True
            continue
        if i < cut and word.startswith("--profiles-dir="):
            continue
        if i < cut and word == f"--profile={name}":
            word = f"--profile={there}"
        out.append(there if i < cut and i > 0 and argv[i - 1] == "--profile" and word == name else word)
    return out


_SUBMITTED = re.compile(r"^(?:submitted job|submitted sweep|task \d+: job|new job) (\S+)", re.MULTILINE)


def _submitted_ids(text: str) -> list[str]:
    return _SUBMITTED.findall(text)


def _logs(conn: Connection, profile: ClusterProfile, name: str, argv: list[str]) -> int:
    """``logs`` through the connection; a dropped connection is reopened (bounded) and the output
    continues where it was cut: nothing printed twice, nothing lost. ``logs -f`` streams framed
    records (``core.logs.Resume``: each line with its file and offset), so the stream that follows a
    drop starts at each file's own offset, however the node logs' lines interleaved and however long
    they were when following began. A one-shot ``logs`` is run again with its first bytes dropped."""
    from orchestrator.runner.logs import Resume

    follow = any(w in ("-f", "--follow") for w in argv)

    class Counting:
        def __init__(self) -> None:
            self.count = 0

        def write(self, data: bytes) -> None:
            sys.stdout.buffer.write(data)
            self.count += len(data)

        def flush(self) -> None:
            sys.stdout.buffer.flush()

    class Framed:
        """Prints each record's line as it arrives and keeps where every file is."""

        def __init__(self) -> None:
            self.resume, self.partial = Resume(), b""

        def write(self, data: bytes) -> None:
            *records, self.partial = (self.partial + data).split(b"\n")
            for raw in records:
                try:
                    text = self.resume.take(json.loads(raw))
                except (ValueError, KeyError, TypeError):  # not a record: shown as it came
                    text = raw.decode(errors="replace") + "\n"
                if text is not None:
                    sys.stdout.write(text)
            sys.stdout.flush()

        def flush(self) -> None:
            sys.stdout.flush()

    counting, framed = Counting(), Framed()
    while True:
        if follow:
            state = ["--resume-from", framed.resume.to_json()] if framed.resume.started() else []
            words = [*run_words(profile), "--", *argv, "--framed", *state]
            framed.partial = b""  # a record cut by the drop comes again, whole
        else:
            words = [*run_words(profile, skip=counting.count), "--", *argv]
        sink = framed if follow else counting
        rc, _, said = run_agent(conn, profile, name, words, stdout=sink, ssh_failure=False)  # type: ignore[arg-type]
        if rc != SSH_FAILED:
            sys.stderr.write(said)
            return rc
        print(f"orchestrator logs: connection to {conn.host} lost; reconnecting", file=sys.stderr)
        _reconnect(conn)


def _reconnect(conn: Connection) -> None:
    """Reopen the master within :data:`RECONNECT_S` of a drop (a host rebooting, a link coming back);
    a host that now asks for a password fails at once, as on any call."""
    from orchestrator.remote.ssh import NeedsLogin

    deadline = time.monotonic() + RECONNECT_S
    while True:
        try:
            conn.ensure_master()
            return
        except NeedsLogin:
            raise
        except UserError:
            if time.monotonic() > deadline:
                raise
        time.sleep(2.0)  # a retry pace against a host that is away, not a synchronisation


def _status_json(conn: Connection, profile: ClusterProfile, target: Target, argv: list[str]) -> int:
    """``status --json JOB...``: ended jobs from the book (no round trip), the rest in one call."""
    import json

    ids = [w for w in argv[1:] if not w.startswith("-")]
    known = {i: row for i in ids if (row := book.final_row(i, target)) is not None}
    ask = [i for i in ids if i not in known]
    rows: list[dict[str, object]] = []
    data: dict[str, object] = {"source": "cache", "stale": False, "errors": [], "jobs": rows}
    if ask or not ids:
        flags = [w for w in argv[1:] if w.startswith("-")]
        words = [*run_words(profile), "--", "status", *flags, *ask]
        rc, out, said = run_agent(conn, profile, target.name, words)
        sys.stderr.write(said)
        if rc != 0:
            return rc
        data = json.loads(out)
        fetched = {str(r["job_id"]): r for r in data.get("jobs", [])}  # type: ignore[attr-defined]
        book.remember_final(target, [r for r in fetched.values() if r.get("terminal")])
        if not ids:
            rows = list(fetched.values())
        else:
            rows = [known.get(i) or fetched[i] for i in ids if i in known or i in fetched]
    else:
        rows = [known[i] for i in ids]
    data["jobs"] = rows
    print(json.dumps(data, indent=2))
    return 0


def _plot(conn: Connection, profile: ClusterProfile, name: str, argv: list[str]) -> int:
    """``plot``: the run's metrics are fetched (one call) and the picture drawn here, into ``-o`` or
    ``./<job>.png`` (the run directory is on the login host)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="orchestrator plot")
    parser.add_argument("job")
    parser.add_argument("-o", "--output")
    args = parser.parse_args(argv[1:])
    rc, out, said = _fetch(conn, profile, name, args.job)
    if rc != 0:
        sys.stderr.write(said)
        return rc
    print(_draw(json.loads(out), args.job, args.output))
    return 0


def plot_here(target: Target, job_id: str, output: str | None) -> Path:
    """The Python API's ``plot`` of a job on the login host of ``target``: drawn here as ``plot``
    draws it (into ``output`` or ``./<job>.png``); the file written."""
    import json

    profile, conn = _connect(target)
    rc, out, said = _fetch(conn, profile, target.name, job_id)
    if rc != 0:
        raise UserError(f"plot on the login host of {target.name}: {said.strip() or f'exit {rc}'}")
    return _draw(json.loads(out), job_id, output)


def _fetch(conn: Connection, profile: ClusterProfile, name: str, job_id: str) -> tuple[int, bytes, str]:
    """The agent's ``fetch``: the run's files a plot is drawn from, as JSON."""
    home = ["--home", profile.login.home] if profile.login.home else []
    return run_agent(conn, profile, name, ["fetch", *home, job_id])


def _draw(fetched: dict[str, Any], job_id: str, output: str | None) -> Path:
    from orchestrator.rundir.plotting import plot_run

    target = Path(output or f"{job_id}.png")
    if target.suffix.lower() != ".png":
        raise UserError(f"-o {target}: only PNG output is supported (name it *.png)")
    with tempfile.TemporaryDirectory() as tmp:
        for file_name, text in fetched["files"].items():
            (Path(tmp) / Path(file_name).name).write_text(text)
        return plot_run(tmp, target, job_id)
