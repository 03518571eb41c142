"""What a rank sees and leaves behind, for the launcher tests (``--out DIR``).

Every rank writes ``rank_<RANK>.json``: its whole environment, ``sys.argv``, ``sys.path[0]``,
``__name__``, torch's thread count and the world as the process group reports it. Then, to show
that the process ends as Python would end it: a file is left open with unflushed text, an
``atexit`` function and a non-daemon thread each write a marker after ``main()`` has returned.
A fourth marker, ``teardown_<RANK>.txt``, is written only by the interpreter's teardown (an object
hung on ``sys``, released when the ``sys`` module is cleared): a rank the product started never
reaches it. ``--exit-code N`` leaves with ``sys.exit(N)`` on every rank. ``--leave-child``: rank 0 leaves a
process behind that holds its stdout (``sleep 600``; its pid in ``child.pid``).
"""

import argparse
import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy
import torch
import torch.distributed as dist


class AtTeardown:
    """Writes its marker when freed; kept on ``sys``, it is freed by the interpreter's teardown only."""

    def __init__(self, path: Path) -> None:
        # os.write bound now: by teardown the module globals may be gone.
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), os.write

    def __del__(self) -> None:
        self.write(self.fd, b"teardown ran")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--leave-child", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    rank = os.environ["RANK"]
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    seen = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "path0": sys.path[0],
        "name": __name__,
        "threads": torch.get_num_threads(),
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "all_reduce": total.item(),
        "seeds": [torch.initial_seed(), float(numpy.random.random())],
        "environ_area": b"\0PATH=" in b"\0" + Path("/proc/self/environ").read_bytes(),
        "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(seen))
    print(f"probe rank {rank} of {dist.get_world_size()}", flush=True)
    left_open = open(out / f"left_open_{rank}.txt", "w")  # noqa: SIM115 (left open on purpose)
    left_open.write("written, never flushed by the script")
    globals()["left_open"] = left_open
    atexit.register(lambda: (out / f"atexit_{rank}.txt").write_text("ran"))

    def late() -> None:
        time.sleep(0.5)
        (out / f"thread_{rank}.txt").write_text("joined")

    threading.Thread(target=late).start()
    sys.orchestrator_probe_teardown = AtTeardown(out / f"teardown_{rank}.txt")  # type: ignore[attr-defined]
    dist.destroy_process_group()
    if args.leave_child and rank == "0":
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # stdout: inherited
        (out / "child.pid").write_text(str(child.pid))
    if args.exit_code:
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
