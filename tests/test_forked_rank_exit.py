"""A forked rank's Accelerator lives until the rank's ``os._exit``.

Freed when a script's ``main()`` returned, DDP's Reducer dropped the last reference to the gloo
process group, whose destructor joins its worker threads while holding the GIL; a worker still
destroying the final barrier's work waited for the GIL: the rank hung after "done" (2 resumed local
2 x 2 runs in ~20, native stacks in ../shared/FIELD_NOTES.md). The script hook keeps the Accelerator
of a rank the direct launcher forked, so nothing of it is destroyed before the process ends. The race
itself is too rare to wait for in a test; what is asserted is the mechanism, through ``submit``."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import run_cli

SCRIPT = """
import gc, os, sys, weakref
from accelerate import Accelerator
accelerator = Accelerator()
ref = weakref.ref(accelerator)
del accelerator
gc.collect()
with open(f"{sys.argv[1]}.rank{os.environ['RANK']}", "w") as fh:
    fh.write(f"{ref() is not None} {os.environ.get('ORCHESTRATOR_FORKED_RANK')}")
"""


def test_a_forked_ranks_accelerator_outlives_the_script(orch_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "drop_accelerator.py"
    script.write_text(SCRIPT)
    out = tmp_path / "alive"
    res = run_cli(
        ["submit", "--profile", "local", "--nodes", "1", "--procs-per-node", "2", "--wait", "--poll", "0.5",
         "--", str(script), str(out)],
        orch_env,
        timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert [Path(f"{out}.rank{r}").read_text() for r in range(2)] == ["True 1", "True 1"]
