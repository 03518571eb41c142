"""Which rank the direct launcher blames (orchestrator/node/direct_launch.py), whatever the order in
which it sees its ranks' deaths (issue 41 item 8, issue 47).

On a busy machine the launcher can be descheduled while one rank raises and its peer dies of it
(gloo's "connection closed by peer") or of a stop's SIGTERM; it then reaps both in one pass. Here
that order is made for real: the launcher is stopped (SIGSTOP), rank 1 raises, rank 0 dies of it
(its socket to rank 1 closes) or of a SIGTERM, both are zombies, and the launcher is continued. It
must still name rank 1 and exit with rank 1's code: before, it took the first rank of its pass,
rank 0 (the node exited 143, the SIGTERM's code, where rank 1 had raised).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import REPO, kill_tree, poll

#: Rank 1 serves a socket, waits for the test's word on a FIFO, then raises. Rank 0 holds a
#: connection to it and, when rank 1 is gone, dies as a gloo peer does (``peer``) or waits for the
#: test's SIGTERM (``term``).
RANKS = r"""
import os, signal, socket, sys, time
from pathlib import Path

here = Path(os.environ["BLAME_DIR"])
address = str(here / "rank1.sock")
if os.environ["RANK"] == "1":
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(1)
    conn, _ = server.accept()
    with open(here / "go", "rb") as go:  # blocks until the test writes
        go.read(1)
    raise ValueError("rank 1's own error")
conn = socket.socket(socket.AF_UNIX)
deadline = time.monotonic() + 120
while True:
    try:
        conn.connect(address)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
(here / "connected").write_text("")
if sys.argv[1] == "term":
    while True:
        signal.pause()
conn.recv(1)  # b"": rank 1 is gone
raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:7605")
"""

LAUNCHER = r"""
import json, os, sys
from orchestrator.node.direct_launch import run_ranks

script, mode, log_dir = sys.argv[1:4]
base = dict(os.environ)
envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)]
sys.exit(run_ranks(script, [mode], envs, log_dir))
"""


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The launchers a test starts: continued and killed, with every process under them, at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        kill_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=30)


def _zombie(pid: int) -> bool:
    """Dead and waiting for its parent: a zombie with no thread left (``waitpid`` does not report a
    process whose first thread is a zombie while another of its threads is still exiting)."""
    try:
        return (
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE and len(os.listdir(f"/proc/{pid}/task")) == 1
        )
    except (psutil.NoSuchProcess, FileNotFoundError):
        return False


@pytest.mark.parametrize("peer_death", ["peer", "term"])
def test_the_rank_that_raised_is_the_cause_when_its_peers_death_is_reaped_with_it(
    tmp_path: Path, launched: list[subprocess.Popen[bytes]], peer_death: str
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    os.mkfifo(tmp_path / "go")
    logs, out = tmp_path / "ranks", tmp_path / "launcher.log"
    env = {**os.environ, "BLAME_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    with open(out, "wb") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(script), peer_death, str(logs)],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    launched.append(launcher)
    pids = poll(
        lambda: (logs / "rank_pids.json").exists() and json.loads((logs / "rank_pids.json").read_text()),
        120,
        "the launcher to fork its ranks",
        interval=0.05,
        diagnostics=out.read_text,
    )["ranks"]
    rank0, rank1 = int(pids["0"]), int(pids["1"])
    poll(lambda: (tmp_path / "connected").exists(), 120, "rank 0 connected to rank 1", 0.05, out.read_text)

    os.kill(launcher.pid, signal.SIGSTOP)  # the busy machine's descheduled launcher, made for real
    poll(lambda: psutil.Process(launcher.pid).status() == psutil.STATUS_STOPPED, 30, "launcher stopped", 0.05)
    fd = poll(lambda: _open_writer(tmp_path / "go"), 60, "rank 1 reading its FIFO", 0.05)
    os.write(fd, b"x")
    os.close(fd)
    poll(lambda: _zombie(rank1), 60, "rank 1 to raise and exit", 0.05, out.read_text)
    if peer_death == "term":
        os.kill(rank0, signal.SIGTERM)  # the stop a job relays to every rank
    poll(lambda: _zombie(rank0), 60, "rank 0 to die of rank 1's death", 0.05, out.read_text)
    os.kill(launcher.pid, signal.SIGCONT)

    code = launcher.wait(timeout=120)
    log = out.read_text()
    assert "ValueError: rank 1's own error" in log, log
    blamed = [line for line in log.splitlines() if " exited with code " in line]
    assert blamed and blamed[0].startswith("[orchestrator launch] rank 1 (local 1) exited with code 1"), log
    assert code == 1, log


def _open_writer(fifo: Path) -> int | None:
    """The FIFO's write end once its reader (rank 1) has opened it; None until then."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None
