"""Resume, requeue and live progress for a Hugging Face ``Trainer`` script: one line each.

::

    from orchestrator.hf import OrchestratorCallback, last_complete_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[OrchestratorCallback()])
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))

Submitted through ``orchestrator submit``, an *unchanged* ``Trainer`` script gets both lines from the
node's import hook (:mod:`orchestrator.rank.script_hooks`; ``--no-script-hooks`` turns it off).

* Transformers writes ``checkpoint-N`` in place, so a kill mid-save leaves a folder that looks like a
  checkpoint. The callback marks each one complete (``COMPLETE.json``: every file's size and digest)
  once every rank has finished writing it, and :func:`last_complete_checkpoint` takes the newest one
  that is marked by this run and intact; a torn one is skipped with a warning.
* The stop request (USR2 or TERM) is agreed by all ranks at a step boundary
  (:mod:`orchestrator.rank.stop`); they save that step, and the job leaves with exit 75 for a requeue.
  (Transformers' own ``enable_jit_checkpoint`` handles TERM only, on a timer per rank: see docs/your-script.md.)
* ``on_log`` and each step feed ``metrics.jsonl`` for ``status``, ``logs``, ``plot`` and the ETA.
* Where the checkpoints are: rank 0 records the ``output_dir`` in the run directory
  (``checkpoint_dirs.json``), so ``orchestrator resume`` finds the newest complete ``checkpoint-N``
  of this run and ``status`` shows it.
* A run never overwrites another run's checkpoints: :func:`refuse_foreign_checkpoints` stops the job
  before training (exit 2) when ``output_dir`` holds ``checkpoint-N`` folders this run did not write,
  naming the run and ``orchestrator resume JOB``; ``ORCHESTRATOR_OVERWRITE_CHECKPOINTS=1`` trains
  there anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.contract.attempt_start import write_attempt_start
from orchestrator.contract.checkpoints import mark_complete_in_place, newest_complete
from orchestrator.contract.env import OVERWRITE_CHECKPOINTS_ENV, RUN_DIR_ENV, STRATEGY_ENV
from orchestrator.contract.heartbeat import Heartbeat
from orchestrator.contract.hook_checkpoints import (
    hook_checkpoint_folders,
    hook_steps_being_saved,
    record_hook_checkpoint_dir,
    run_identity,
)
from orchestrator.contract.run_dir import (
    COMPLETE_MARKER,
    EXIT_REQUEUE,
    JOB_ID_FILE,
    METRICS_FILE,
    read_json,
    write_exit_status,
)
from orchestrator.rank.stop import StopRequest, any_rank, barrier, broadcast_from_main

HOOK = "trainer"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
#: Progress lines between Trainer logs (its ``logging_steps`` is often hundreds of steps): at most one
#: a second, with the newest logged loss.
STEP_EVENT_INTERVAL_S = 1.0


#: Exit code of a run refused before training: its output_dir holds another run's checkpoints.
EXIT_OUTPUT_DIR_TAKEN = 2


def _run_id() -> str | None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    return run_identity(run_dir) if run_dir else None


def _record(output_dir: str | os.PathLike[str], **steps: int) -> None:
    """Rank 0: where this run's checkpoints go (``checkpoint_dirs.json``), and which step is being saved."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(OSError):
            record_hook_checkpoint_dir(Path(run_dir), Path(output_dir), HOOK, **steps)


def foreign_checkpoints(
    output_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str]
) -> list[tuple[Path, str | None]]:
    """``[(folder, the run that wrote it or None)]``: the ``checkpoint-N`` folders in ``output_dir`` that
    this run did not write (marked by another run, or by none and not a save of this run's), newest first."""
    run = run_identity(run_dir)
    ours_unmarked = hook_steps_being_saved(Path(run_dir), Path(output_dir))
    found = []
    for step, folder in hook_checkpoint_folders(Path(output_dir)):
        marker = read_json(folder / COMPLETE_MARKER)
        owner = marker.get("run") if marker is not None else None
        if owner == run or (marker is None and step in ours_unmarked):
            continue
        found.append((folder, owner if isinstance(owner, str) else None))
    return found


def _refusal(output_dir: str | os.PathLike[str], run_dir: str) -> str | None:
    found = foreign_checkpoints(output_dir, run_dir)
    if not found:
        return None
    names = ", ".join(folder.name for folder, _ in found[:4]) + (", ..." if len(found) > 4 else "")
    owners = sorted({owner for _, owner in found if owner})
    if owners:
        try:
            job = (Path(owners[0]) / JOB_ID_FILE).read_text().strip() or None
        except OSError:
            job = None
        whose = f"of run {owners[0]}" + (f" (job {job})" if job else "")
        cont = f"continue that run with `orchestrator resume {job}`" if job else "continue that run"
    else:
        whose = "not written by an orchestrator run (no COMPLETE.json naming one)"
        cont = "move them away"
    return (
        f"error: output_dir {Path(output_dir).resolve()} holds checkpoints {whose}: {names}; this run "
        f"would overwrite them, so it stops before training. {cont[0].upper()}{cont[1:]}, give this run "
        f"another output_dir, or set {OVERWRITE_CHECKPOINTS_ENV}=1 to train there anyway"
    )


def refuse_foreign_checkpoints(output_dir: str | os.PathLike[str]) -> None:
    """Stop every rank before training (exit 2) when ``output_dir`` holds checkpoints of another run;
    a run that goes on (a requeue, ``orchestrator resume``) finds only its own. Rank 0 decides; call it
    on every rank. Outside a job, or with ``ORCHESTRATOR_OVERWRITE_CHECKPOINTS=1``, it does nothing."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    decide = os.environ.get("RANK", "0") == "0" and os.environ.get(OVERWRITE_CHECKPOINTS_ENV, "") != "1"
    why = broadcast_from_main(_refusal(output_dir, run_dir) if decide else None)
    if why is None:
        _record(output_dir)
        return
    if os.environ.get("RANK", "0") == "0":
        print(why, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            write_exit_status(Path(run_dir), EXIT_OUTPUT_DIR_TAKEN, "output_dir", problems=[why])
    barrier()
    raise SystemExit(EXIT_OUTPUT_DIR_TAKEN)


def _say_on_rank0(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[orchestrator.hf] {line}", file=sys.stderr, flush=True)


def last_complete_checkpoint(output_dir: str | os.PathLike[str], warn: Any = None) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that this run marked complete and whose files
    all match the marker (sizes and digests), or None: pass it to ``trainer.train(resume_from_checkpoint=)``.

    A checkpoint from another run in the same ``output_dir`` (an earlier job) is never taken: a new
    run starts from scratch, as Transformers does, while a requeue or ``orchestrator resume`` of this
    run continues. Rank 0 decides (reading the files once) and every rank gets its answer, so all of
    them restore the same checkpoint; call it on every rank."""
    choice = None
    if os.environ.get("RANK", "0") == "0":
        say = warn or _say_on_rank0
        root, run = Path(output_dir), _run_id()
        try:
            found = [
                (int(m.group(1)), Path(e.path))
                for e in os.scandir(root)
                if (m := _CHECKPOINT_RE.match(e.name))
            ]
        except OSError:
            found = []

        def ours() -> Any:
            for _, folder in sorted(found, reverse=True):
                marker = read_json(folder / COMPLETE_MARKER)
                if run is not None and marker is not None and marker.get("run") != run:
                    say(f"skipping {folder}: written by another run ({marker.get('run')})")
                    continue
                yield folder

        newest = newest_complete(ours(), lambda line: say(line.replace("warning: ", "")))
        choice = str(newest[0]) if newest else None
    return broadcast_from_main(choice)


def save_full_model(trainer: Any, output_dir: str | None) -> bool:
    """``trainer.save_model(output_dir)`` under FSDP with a sharded state dict: Transformers saves only a
    full one and otherwise writes nothing, silently. Gather the full weights (a collective: every rank
    calls ``save_model``) and let rank 0 write them as ``save_model`` would (``save_pretrained``: loadable
    with ``from_pretrained``). False when Transformers saves them itself (a full state dict)."""
    plugin = trainer.accelerator.state.fsdp_plugin
    if "FULL_STATE_DICT" in str(plugin.state_dict_type):
        return False
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Offloading gathers onto rank 0's CPU only; on CPU the tensors are there already, and FSDP1's
    # offload_to_cpu segfaults there (FIELD_NOTES).
    offload = torch.cuda.is_available()
    state_dict = get_model_state_dict(
        trainer.model_wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=offload)
    )
    target = output_dir if output_dir is not None else trainer.args.output_dir
    trainer._save(target, state_dict=state_dict)
    _say_on_rank0(
        f"save_model({target}): FSDP with a sharded state dict ({plugin.state_dict_type}); "
        "gathered the full weights, written by rank 0"
    )
    barrier()
    return True


#: What ``save_pretrained`` writes beside a model's weights, and :func:`save_model_config` adds to a
#: ``checkpoint-N`` without them (FSDP with a sharded state dict: the Trainer saves no config there).
MODEL_CONFIG_FILES = ("config.json", "generation_config.json")


def save_model_config(model: Any, folder: Path) -> list[str]:
    """Rank 0, before the checkpoint's marker: the model's ``config.json`` (and ``generation_config.json``
    when it generates) into ``folder`` where the Trainer wrote none, as ``save_pretrained`` writes them
    (``architectures`` named, the weights' dtype), so that ``export --format hf`` loads the checkpoint
    with no ``--config``. A file the Trainer wrote is left as it is; each one appears whole (written
    aside, then renamed). Returns the names written; none for a model that is not a transformers one
    (or a PEFT adapter, whose config ``save_pretrained`` does not write either)."""
    import copy
    import shutil
    import uuid

    from transformers import PreTrainedModel
    from transformers.modeling_utils import unwrap_model

    inner = unwrap_model(model)
    if not isinstance(inner, PreTrainedModel) or getattr(inner, "_hf_peft_config_loaded", False):
        return []
    generation = getattr(inner, "generation_config", None) if inner.can_generate() else None
    wanted = MODEL_CONFIG_FILES if generation is not None else MODEL_CONFIG_FILES[:1]
    missing = [name for name in wanted if not (folder / name).exists()]
    if not missing:
        return []
    config = copy.deepcopy(inner.config)  # the live model's config stays as the script left it
    config.architectures = [type(inner).__name__.removeprefix("FSDP")]  # FSDP2 renames the class
    with contextlib.suppress(Exception):
        config.dtype = str(inner.dtype).split(".")[1]
    aside = folder / f".orchestrator-config-{uuid.uuid4().hex[:8]}"
    try:
        aside.mkdir()
        config.save_pretrained(aside)
        if generation is not None:
            generation.save_pretrained(aside)
        for name in missing:
            os.replace(aside / name, folder / name)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return missing


def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class CallbackMixin:
    """The behaviour; :class:`OrchestratorCallback` mixes it into ``TrainerCallback`` lazily so that
    importing this module does not import transformers."""

    def __init__(self) -> None:
        self.stop = StopRequest().install()
        self.stopping = False
        self.last_loss: float | None = None
        self.last_step_event = 0.0
        self.step_started = time.monotonic()
        self._metrics: Any = None
        self.resumed_from: str | None = None
        #: refuse_foreign_checkpoints ran (the script hook runs it before choosing a checkpoint).
        self.guarded = False
        #: For the hang watchdog (None outside a job): the Trainer's events give data/forward (step
        #: begin), optimizer (before its step) and checkpoint (a save decided at step end).
        self.heartbeat = Heartbeat.for_this_rank()

    def _beat(self, step: int, phase: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step, phase)

    # -- output
    def _write(self, state: Any, record: dict[str, Any]) -> None:
        run_dir = os.environ.get(RUN_DIR_ENV)
        if not run_dir or not state.is_world_process_zero:
            return
        if self._metrics is None:
            self._metrics = open(Path(run_dir) / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._metrics.write(json.dumps({**record, "time": time.time()}) + "\n")
        self._metrics.flush()

    def _train_event(self, state: Any, extra: dict[str, Any]) -> None:
        record: dict[str, Any] = {"event": "train", "step": int(state.global_step)}
        if state.max_steps:
            record["max_steps"] = int(state.max_steps)
        if self.last_loss is not None:
            record["loss"] = self.last_loss
        world = os.environ.get("WORLD_SIZE")
        if world and world.isdigit():
            record["world_size"] = int(world)
        if os.environ.get(STRATEGY_ENV):
            record["strategy"] = os.environ[STRATEGY_ENV]
        self._write(state, {**record, **extra})

    # -- Trainer events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.guarded:  # the callback added by hand: before the first step, still nothing overwritten
            self.guarded = True
            refuse_foreign_checkpoints(args.output_dir)
        if state.is_world_process_zero:
            step = int(state.global_step)
            checkpoint = None
            if step > 0:  # Trainer restored global_step from checkpoint-<step>
                checkpoint = self.resumed_from or str(Path(args.output_dir) / f"checkpoint-{step}")
                self._write(state, {"event": "resume", "step": step, "checkpoint": checkpoint})
            write_attempt_start(step, checkpoint, HOOK)
        self.step_started = time.monotonic()
        self._beat(int(state.global_step) + 1, "data")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._beat(int(state.global_step) + 1, "forward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._beat(int(state.global_step) + 1, "optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        step_time, self.step_started = now - self.step_started, now
        if now - self.last_step_event >= STEP_EVENT_INTERVAL_S:
            self.last_step_event = now
            self._train_event(state, {"step_time_s": step_time})
        if any_rank(self.stop.signum != 0):
            self.stopping = True
            control.should_save = True
            # The stop signal reached every process of the step, the script's logging services too
            # (wandb's service process dies of TERM): a log call now raises in the rank before the
            # checkpoint is written. The step is saved, not logged.
            control.should_log = False
        self._beat(int(state.global_step) + 1, "data")
        if control.should_save:
            self._beat(int(state.global_step), "checkpoint")
        if control.should_save and state.is_world_process_zero:
            _record(args.output_dir, saving=int(state.global_step))
            # Transformers rewrites checkpoint-<step> in place when it exists (a step trained again after
            # a resume from an older checkpoint): the old marker must not vouch for half-new files.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE_MARKER)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        logs = logs or {}
        if isinstance(logs.get("loss"), (int, float)):
            self.last_loss = float(logs["loss"])
            extra = (
                {"lr": logs["learning_rate"]} if isinstance(logs.get("learning_rate"), (int, float)) else {}
            )
            if isinstance(logs.get("grad_norm"), (int, float)):
                extra["grad_norm"] = float(logs["grad_norm"])
            self._train_event(state, extra)
        if isinstance(logs.get("eval_loss"), (int, float)):
            self._write(
                state, {"event": "eval", "step": int(state.global_step), "val_loss": float(logs["eval_loss"])}
            )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        barrier()  # every rank has written its part of the folder
        if state.is_world_process_zero and folder.is_dir():
            # Before the marker: a complete checkpoint carries its model's config (FSDP's has none).
            try:
                save_model_config(kwargs.get("model"), folder)
            except Exception as exc:  # the weights are whole; a config that will not save costs only it
                _say_on_rank0(f"{folder}: the model's config could not be saved there ({exc})")
            mark_complete_in_place(
                folder,
                {"step": int(state.global_step), "time": time.time(), "hook": HOOK, "run": _run_id()},
            )
            _record(args.output_dir, saved=int(state.global_step))
        barrier()
        self._beat(int(state.global_step) + 1, "data")
        if self.stopping:
            self._leave(state)

    def _leave(self, state: Any) -> None:
        run_dir = os.environ.get(RUN_DIR_ENV)
        if state.is_world_process_zero:
            if run_dir:
                write_exit_status(Path(run_dir), EXIT_REQUEUE, "signal", step=int(state.global_step))
            print(f"[orchestrator.hf] requeue: checkpoint-{state.global_step} saved", flush=True)
        if self._metrics is not None:
            self._metrics.close()
        barrier()
        raise SystemExit(EXIT_REQUEUE)


def __getattr__(name: str) -> Any:
    # ``OrchestratorCallback`` is a real TrainerCallback subclass, built on first use.
    if name == "OrchestratorCallback":
        cls = type(
            "OrchestratorCallback", (CallbackMixin, _trainer_callback_base()), {"__module__": __name__}
        )
        globals()[name] = cls
        return cls
    raise AttributeError(name)
