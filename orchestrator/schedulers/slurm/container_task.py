"""A node's task inside a container image (``python -m orchestrator.schedulers.slurm.container_task
FOLDER``, from ``orchestrator.config.container``): check the image, then run submitit's own entry
point, which unpickles the node task.

It runs from the read-only mount of orchestrator's node side, with the image's interpreter, torch
and accelerate. An image with other versions than the workarounds target is said so in the node's
log at start (a warning); one without torch or accelerate is an error naming the interpreter,
instead of an ImportError deep inside the launcher. Standard library only until submitit runs:
``importlib.metadata`` reads the versions without importing torch.
"""

from __future__ import annotations

import os
import runpy
import sys
from importlib import metadata

from orchestrator.config.container import IN_CONTAINER_ENV, TARGET_VERSIONS, version_report
from orchestrator.contract.env import CONTAINER_REPORT_ENV
from orchestrator.schedulers.slurm.environment import fill_task_variables

#: Exit status for an image that cannot train at all.
EXIT_BAD_IMAGE = 3


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    found = {name: _installed(name) for name in TARGET_VERSIONS}
    described = ", ".join(f"{k} {v or 'missing'}" for k, v in found.items())
    say = "orchestrator container:"
    warnings, errors = version_report(found, sys.executable)
    report = [f"{say} python {sys.version.split()[0]} ({sys.executable}), {described}"]
    report += [f"{say} WARNING: {line}" for line in warnings]
    report += [f"{say} ERROR: {line}" for line in errors]
    for line in report:  # submitit's log: the only one an image that cannot train reaches
        print(line, file=sys.stderr)
    if errors:
        return EXIT_BAD_IMAGE
    # The node log, which ``orchestrator logs`` shows, is opened by the node entry: it writes these.
    os.environ[CONTAINER_REPORT_ENV] = "\n".join(report)
    if os.environ.get(IN_CONTAINER_ENV) == "oci":
        fill_task_variables(os.environ)
    sys.stderr.flush()
    sys.argv = ["submitit.core._submit", *argv]
    runpy.run_module("submitit.core._submit", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
