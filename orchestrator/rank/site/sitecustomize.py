"""Fix-ups every rank of a job gets without a line in the user's script, applied at import time.

In a rank torchrun started, it then runs the job's script itself and leaves without the
interpreter's teardown (:func:`run_the_script_and_leave`). Three groups of patches, each applied to a
module when (and only if) the script imports it:

* the script hooks (``ORCHESTRATOR_SCRIPT_HOOKS=1``, set by the node entry unless
  ``--no-script-hooks``): workarounds and self-check in ``Accelerator``, resume and the agreed stop
  in ``Trainer``; the patches live in :mod:`orchestrator.rank.script_hooks`;
* DeepSpeed on CPU, below;
* no DeepSpeed import in jobs that do not use DeepSpeed (:func:`_deepspeed_only_if_imported`).

DeepSpeed on CPU nodes gets the gloo backend:

On a machine without CUDA, ``PartialState`` (accelerate 1.15) finds no backend for a DeepSpeed launch:
DeepSpeed starts its process group, but Accelerate keeps ``backend=None``, believes the world size
is 1, and DeepSpeed asserts on ``train_batch_size`` (it sees the real world). Scripts avoid that with
``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])``; users' unmodified scripts
do not have that line. The node entry point puts this folder first on ``PYTHONPATH`` for DeepSpeed jobs
on CPU profiles only; Python imports ``sitecustomize`` at start-up in every rank, and this one wraps
``PartialState._prepare_backend`` when (and only if) ``accelerate.state`` is imported, so that a
missing backend becomes gloo exactly as that line would make it, and makes
``deepspeed.comm.torch.build_shm_op`` find no op. Nothing is imported eagerly. A
``sitecustomize`` further down the path (the distribution's own) still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from orchestrator.contract.env import DISABLE_WORKAROUNDS_ENV, FORKED_RANK_ENV, RUN_DIR_ENV, SCRIPT_HOOKS_ENV

_HERE = str(Path(__file__).resolve().parent)


def _wanted() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _patch(module: ModuleType) -> None:
    state = module.PartialState
    original = state._prepare_backend
    if getattr(original, "_orchestrator_gloo", False):
        return

    def _prepare_backend(
        self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: Any = None
    ) -> Any:
        import torch

        if backend is None and not cpu and _wanted() and not torch.cuda.is_available():
            backend = "gloo"
        return original(self, cpu, sagemaker_dp, backend)

    _prepare_backend._orchestrator_gloo = True  # type: ignore[attr-defined]
    state._prepare_backend = _prepare_backend


def _no_shm_op(module: ModuleType) -> None:
    def build_shm_op() -> None:
        return None

    module.build_shm_op = build_shm_op  # type: ignore[attr-defined]


_DEEPSPEED_PATCHES = {"accelerate.state": _patch, "deepspeed.comm.torch": _no_shm_op}


def _deepspeed_only_if_imported(module: ModuleType) -> None:
    """``accelerate.utils.other.extract_model_from_parallel`` (behind ``unwrap_model``, ``save_model``,
    ``get_state_dict`` and every ``Trainer()``) imports ``deepspeed`` whenever it is installed (the
    ``train`` extra installs it), only to ask ``isinstance(model, DeepSpeedEngine)``. That import makes
    DeepSpeed probe for an accelerator, and on a CPU node every rank of every job logs "Setting
    accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.". A model can
    be a ``DeepSpeedEngine`` only once ``deepspeed`` has been imported, so the question is asked only
    then: the same answer, without the import and its warning. Applied to jobs that do not use DeepSpeed
    (a DeepSpeed job imports it in ``Accelerator()`` anyway)."""
    original = module.is_deepspeed_available
    if getattr(original, "_orchestrator_if_imported", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and bool(original())

    is_deepspeed_available._orchestrator_if_imported = True  # type: ignore[attr-defined]
    module.is_deepspeed_available = is_deepspeed_available  # type: ignore[attr-defined]


def _patches() -> dict[str, Any]:
    patches: dict[str, Any] = (
        dict(_DEEPSPEED_PATCHES) if _wanted() else {"accelerate.utils.other": _deepspeed_only_if_imported}
    )
    if os.environ.get(SCRIPT_HOOKS_ENV, "0") == "1":
        from orchestrator.rank.script_hooks import PATCHES

        patches.update(PATCHES)
    elif os.environ.get(FORKED_RANK_ENV) == "1" or _script_to_run() is not None:
        # Without the hooks (train/, --no-script-hooks) a rank that leaves by os._exit still keeps what
        # Accelerate prepared until then: the patch then only does that (script_hooks._keep_until_exit).
        from orchestrator.rank.script_hooks import patch_accelerator

        patches["accelerate.accelerator"] = patch_accelerator
    return patches


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``patches`` as the path finder would, and patches each right after it ran."""

    def __init__(self, patches: dict[str, Any]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if any (Debian's python has one)."""
    rest = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _belong_to_the_run() -> None:
    """A rank torchrun started (``launcher: torchrun``) takes the run's lock and
    dies with its parent, as a forked rank does (:mod:`orchestrator.contract.run_alive`). Measured
    before: ``kill -9`` of the node entry took the launcher, and torchrun's workers trained on under
    PID 1, holding no lock, while ``status`` called the job ended."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir or "LOCAL_RANK" not in os.environ or os.environ.get(FORKED_RANK_ENV) == "1":
        return
    from orchestrator.contract import run_alive

    run_alive.die_with_parent(os.getppid())
    run_alive.hold(run_dir)


def apply(chain: bool = True) -> None:
    """Patch the modules already imported, hook the others. A rank forked from a launcher that
    imported accelerate (orchestrator.node.direct_launch) calls this itself, with ``chain=False``: the
    distribution's ``sitecustomize`` already ran in that interpreter."""
    _belong_to_the_run()
    patches = _patches()
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    rest = {name: patch for name, patch in patches.items() if name not in sys.modules}
    if rest:
        sys.meta_path.insert(0, _Finder(rest))
    if chain:
        _chain_next_sitecustomize()


def _script_to_run() -> str | None:
    """The job's script, when this process is a rank torchrun started for it (``python -u SCRIPT``)."""
    script = sys.argv[0] if sys.argv else ""
    if (
        not os.environ.get(RUN_DIR_ENV)
        or "LOCAL_RANK" not in os.environ
        or os.environ.get(FORKED_RANK_ENV) == "1"
        or os.environ.get(DISABLE_WORKAROUNDS_ENV) == "1"
        or not script.endswith(".py")
        or not os.path.isfile(script)
    ):
        return None
    return script


def run_the_script_and_leave() -> None:
    """A rank torchrun started (``launcher: torchrun``) runs the job's script
    here and leaves by ``os._exit`` (:mod:`orchestrator.rank.run_script`), as a forked rank does:
    the interpreter's teardown can abort a rank whose script has finished (measured: 1 DeepSpeed
    ZeRO-3 run in 10 on CPU failed so). The script runs as ``python script.py`` would run it: its own
    folder first on ``sys.path`` (the interpreter adds it only after ``site``), ``__main__``, its exit
    code. Not for ``-m``/``-c`` ranks, processes outside a job's rank, or with the workarounds
    disabled (``ORCHESTRATOR_DISABLE_WORKAROUNDS=1``, to measure what this fixes)."""
    script = _script_to_run()
    if script is None:
        return
    from orchestrator.rank.run_script import leave, run_script

    if not getattr(sys.flags, "safe_path", False):  # -P (Python 3.11)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    leave(run_script(script))


if __name__ == "sitecustomize":
    apply()
    run_the_script_and_leave()
