"""How a rank runs the user's script and leaves: Python's exit without the interpreter's teardown.

After a script has trained to the end, the interpreter's teardown (module and object destruction,
where torch's C++ threads and process-group objects go) can abort a rank with SIGABRT ("terminate
called without an active exception") or hang it (FIELD_NOTES: gloo teardown). The job then fails
although its work is done. Measured: an unmodified DeepSpeed ZeRO-3 script under torchrun on CPU,
which writes its results, then calls ``wait_for_everyone()`` and ``end_training()``, had one rank
abort at exit in 1 run of 10 (``tests/train/test_deepspeed_zero.py``).

So every rank the product starts runs the script with :mod:`runpy`, as ``python script.py`` would,
and leaves by ``os._exit`` once the script, its non-daemon threads, its ``atexit`` functions and the
flush of every open file are done. The exit code is the script's own: ``sys.exit(n)`` gives ``n``, an
uncaught exception prints its traceback and gives 1. Two callers: a rank forked by the direct
launcher (:mod:`orchestrator.node.direct_launch`) and a rank torchrun started, from its
``sitecustomize`` (:mod:`orchestrator.rank.site.sitecustomize`). Standard library only.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

#: True once this process runs the script here: it will leave by ``os._exit`` (:func:`leave`).
_RUNNING = False


def running_a_script() -> bool:
    """Whether this process runs the job's script through :func:`run_script` and so never reaches the
    interpreter's teardown: what it prepared may be kept to the end (``script_hooks._keep_until_exit``)."""
    return _RUNNING


def run_script(script: str) -> int:
    """Run ``script`` as ``__main__``; its exit code, as the interpreter would have made it."""
    import runpy

    global _RUNNING
    _RUNNING = True
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        return exit_code(stop.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        return 128 + int(signal.SIGINT)
    except BaseException as error:  # noqa: BLE001 (what Python prints for an uncaught exception)
        trimmed = _from_the_script(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        return 1
    return 0


def _from_the_script(tb: Any) -> Any:
    """The traceback without this module's and runpy's frames, as ``python script.py`` shows it."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name != __file__ and "runpy" not in name:
            break
        tb = tb.tb_next
    return tb


def exit_code(code: object) -> int:
    """``SystemExit.code`` as the process's exit status (a message: printed, status 1)."""
    if code is None or isinstance(code, int):
        return (code or 0) & 0xFF
    print(code, file=sys.stderr)
    return 1


def leave(code: int) -> None:
    """Python's exit without its teardown: threads joined, atexit run, every open file flushed."""
    import atexit
    import threading

    steps: list[Callable[[], Any]] = [atexit._run_exitfuncs, _flush_open_files]
    shutdown = getattr(threading, "_shutdown", None)  # private: what Python's exit runs first
    if shutdown is not None:
        steps.insert(0, shutdown)
    for step in steps:
        try:
            step()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
    os._exit(code)


def _flush_open_files() -> None:
    """Teardown would flush files the script left open; ``os._exit`` does not."""
    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if issubclass(type(obj), buffered):  # type(), not isinstance: no attribute of obj is read
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
