"""Files another host writes into the run directory: every poller looks at such a file only through a
fresh listing of its folder, the open(2) of the directory that makes an NFS client ask the server
again instead of trusting the miss it cached before the file existed (orchestrator.contract.shared_fs).

This machine's kernel has no NFS client, so what is checked is what the kernel's source says
matters: which system calls each poller makes, recorded by a Python audit hook in a fresh
interpreter while another thread writes the file, as the other host would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.contract.run_dir import attempt_dir
from orchestrator.contract.shared_fs import listed, read_json_listed, read_text_listed
from tests.helpers.cli import REPO

#: Runs a poller in a fresh interpreter with an audit hook; prints the poller's result and every
#: listing of the folder and open of the awaited file, in order.
PROBE = r"""
import json, sys, threading, time
from pathlib import Path

folder, name, which = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
calls = []

poller = threading.get_ident()

def hook(event, args):
    if threading.get_ident() != poller:  # the other host's writes
        return
    if event == "os.listdir" and str(args[0]) == str(folder):
        calls.append("list")
    elif event == "open" and isinstance(args[0], str) and args[0].endswith("/" + name):
        calls.append("open")

from orchestrator.contract.jsonfiles import write_json_atomic
from orchestrator.node.restart_in_place import wait_for_next_attempt
from orchestrator.schedulers.base import failed_node
from orchestrator.contract.in_place import ended_in_place

def other_host():
    time.sleep(0.3)  # the pollers have looked several times and found nothing
    if name.endswith(".json"):
        write_json_atomic(folder / name, {"attempt": 1})
    else:
        (folder / "node_1.kept").write_text("")
        (folder / name).write_text("1")

sys.addaudithook(hook)
writer = threading.Thread(target=other_host)
writer.start()
deadline = time.monotonic() + 10
result = None
while result is None and time.monotonic() < deadline:
    if which == "word":
        result = wait_for_next_attempt(folder, 0, [], wait_s=10)
    elif which == "peer":
        result = failed_node(folder, 2, 0)
    else:
        code, kept = ended_in_place(folder.parent.parent, 0, 2)
        result = None if code is None else [code, kept]
    time.sleep(0.05)
writer.join()
print(json.dumps({"result": result, "calls": calls}))
"""


def _poll(tmp_path: Path, name: str, which: str) -> dict:
    folder = attempt_dir(tmp_path / "run", 0)
    folder.mkdir(parents=True)
    (folder / "node_0.kept").write_text("")  # ended_in_place: node 0 kept its launcher and said so
    (folder / "node_0.exit").write_text("1")
    res = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder), name, which],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _every_open_follows_a_listing(calls: list[str]) -> bool:
    """Each open of the awaited file comes after a listing of its folder taken since the last open."""
    listed_since = False
    for call in calls:
        if call == "list":
            listed_since = True
        elif not listed_since:
            return False
        else:
            listed_since = False
    return "open" in calls


def test_a_kept_launcher_reads_the_batch_steps_word_through_a_fresh_listing(tmp_path: Path) -> None:
    seen = _poll(tmp_path, "next_attempt.json", "word")
    assert seen["result"] == 1, seen
    assert _every_open_follows_a_listing(seen["calls"]), seen["calls"]
    assert seen["calls"].count("list") > 2, seen["calls"]  # it looked before the word was there


def test_a_node_reads_the_other_nodes_exit_files_through_a_fresh_listing(tmp_path: Path) -> None:
    seen = _poll(tmp_path, "node_1.exit", "peer")
    assert seen["result"] == [1, 1], seen
    assert _every_open_follows_a_listing(seen["calls"]), seen["calls"]


def test_the_batch_step_reads_the_nodes_marks_through_a_fresh_listing(tmp_path: Path) -> None:
    seen = _poll(tmp_path, "node_1.exit", "in_place")
    assert seen["result"] == [1, True], seen
    assert _every_open_follows_a_listing(seen["calls"]), seen["calls"]


def test_the_helpers_read_only_what_the_listing_holds(tmp_path: Path) -> None:
    assert listed(tmp_path / "missing") == frozenset()
    (tmp_path / "a.json").write_text('{"attempt": 2}')
    (tmp_path / "b").write_text("10.0.0.1\n")
    assert listed(tmp_path) == {"a.json", "b"}
    assert read_json_listed(tmp_path / "a.json") == {"attempt": 2}
    assert read_json_listed(tmp_path / "c.json") is None
    assert read_text_listed(tmp_path / "b") == "10.0.0.1\n"
    # A listing taken before the file was written does not hold it: not read (the caller looks again).
    assert read_text_listed(tmp_path / "b", frozenset({"a.json"})) is None
