"""What every rank of a user's script gets without a line of its own, installed by the node's import hook.

``orchestrator/rank/site/sitecustomize.py`` runs at start-up in every rank of a job (the node entry
puts that folder first on ``PYTHONPATH``) and calls these patches when, and only when, the script
imports the module they patch:

* ``accelerate.accelerator``: ``Accelerator()`` applies the CPU workarounds ``train/`` uses
  (:mod:`orchestrator.rank.workarounds`: FSDP is otherwise silently dropped on CPU, also a
  ``FullyShardedDataParallelPlugin`` built in code) and then the launch self-check; ``prepare`` runs
  the model self-check (FSDP really sharding, DeepSpeed really active). A mismatch stops the job at
  start (exit 3) naming what was asked and what Accelerate did: it never completes as something else.
* ``transformers.trainer``: every ``Trainer`` gets :class:`orchestrator.hf.OrchestratorCallback`, and
  ``train()`` without an explicit checkpoint resumes from :func:`orchestrator.hf.last_complete_checkpoint`,
  and ``save_model()`` under FSDP with a sharded state dict writes the full weights
  (:func:`orchestrator.rank.hf.save_full_model`) instead of nothing.

``ORCHESTRATOR_SCRIPT_HOOKS=0`` (``submit --no-script-hooks``) turns all of it off; ``train/`` sets it for
its own process, since it makes the same calls itself.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

from orchestrator.config.strategies import STRATEGIES
from orchestrator.contract.env import RUN_DIR_ENV, SCRIPT_HOOKS_ENV
from orchestrator.rank import run_script as rank_exit

#: The switch: "1" set by the node entry, "0" to opt out.


#: A rank's Accelerator and everything it prepared, never freed (see _keep_until_exit).
_KEPT_UNTIL_EXIT: list[Any] = []


def _keep_until_exit(obj: Any) -> Any:
    """In a rank that leaves by ``os._exit`` (every rank the product starts: forked by the direct
    launcher, or started by torchrun and run by its ``sitecustomize``), keep ``obj`` until then.

    After ``end_training()`` destroyed the process group, DDP's Reducer holds the last reference to it.
    Freed when the script's ``main()`` returned, the Reducer destroyed ``ProcessGroupGloo``, whose
    destructor joins its worker threads while holding the GIL; a worker still destroying the final
    barrier's work waits for the GIL to free its tensors: a deadlock (torch 2.13, resumed local 2 x 2
    runs, native stacks in FIELD_NOTES). The DDP wrapper is what ``prepare`` returns, the Accelerator
    keeps only the bare model, so both are kept: nothing of them is destroyed before the process ends.
    """
    if rank_exit.running_a_script():
        _KEPT_UNTIL_EXIT.append(obj)
    return obj


def enabled() -> bool:
    return os.environ.get(SCRIPT_HOOKS_ENV, "0") == "1"


def _rank() -> int:
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def patch_accelerator(module: ModuleType) -> None:
    cls = module.Accelerator
    if getattr(cls, "_orchestrator_patched", False):
        return
    original_init, original_prepare = cls.__init__, cls.prepare

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not enabled():
            original_init(self, *args, **kwargs)
            _keep_until_exit(self)
            return
        from orchestrator.rank import selfcheck, workarounds

        try:
            expectation = selfcheck.expectations_from_env()
        except selfcheck.SelfCheckError as exc:
            selfcheck.fail([str(exc)], selfcheck.Expectation(source="the environment"), "", None, _rank())
        pending = workarounds.before_accelerator()
        if kwargs.get("fsdp_plugin") is not None:
            # A plugin built in code asks for FSDP as clearly as the launch config does; on CPU
            # Accelerate drops it, so keep it for enable_fsdp_on_cpu.
            pending.fsdp_requested = True
            pending.fsdp_plugin = kwargs["fsdp_plugin"]
        original_init(self, *args, **kwargs)
        applied = workarounds.after_accelerator(self, pending)
        problems = selfcheck.check_launch(self, expectation)
        cause = in_code_plugin_cause(self, expectation) if kwargs.get("fsdp_plugin") else None
        if problems and cause:
            problems = [cause, *problems]
        if problems:
            selfcheck.fail(problems, expectation, selfcheck._found_launch(self), _run_dir(), _rank())
        self._orchestrator_expectation = expectation
        self._orchestrator_workarounds = applied
        _keep_until_exit(self)

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _keep_until_exit(checked_prepare(self, *args, **kwargs))

    def checked_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        expectation = getattr(self, "_orchestrator_expectation", None)
        if expectation is None or not enabled():
            return original_prepare(self, *args, **kwargs)
        import torch

        from orchestrator.rank import selfcheck

        sizes = [
            sum(p.numel() for p in arg.parameters()) if isinstance(arg, torch.nn.Module) else None
            for arg in args
        ]
        for arg in args:
            # A --wrap-cls the model lacks: exit 3 with the candidates, before Accelerate's own error.
            wrap_problems = selfcheck.check_wrap_class(self, arg) if isinstance(arg, torch.nn.Module) else []
            if wrap_problems:
                selfcheck.fail_wrap(wrap_problems, self.process_index)
        result = original_prepare(self, *args, **kwargs)
        prepared = result if isinstance(result, (tuple, list)) and len(args) > 1 else (result,)

        for size, obj in zip(sizes, prepared):
            if size is None:
                continue
            problems, found = selfcheck.check_model(self, obj, expectation, size)
            if problems:
                selfcheck.fail(problems, expectation, found, _run_dir(), _rank())
            if self.is_main_process:
                applied = ", ".join(getattr(self, "_orchestrator_workarounds", [])) or "none"
                print(
                    f"[orchestrator] self-check ok: {expectation.describe()} ({found}); workarounds: {applied}; "
                    f"device {self.device}",
                    file=sys.stderr,
                    flush=True,
                )
        return result

    cls.__init__ = __init__
    cls.prepare = prepare
    cls._orchestrator_patched = True


def patch_trainer(module: ModuleType) -> None:
    cls = module.Trainer
    if getattr(cls, "_orchestrator_patched", False):
        return
    original_init, original_train, original_save_model = cls.__init__, cls.train, cls.save_model
    original_log = cls.log

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if not enabled():
            return
        from orchestrator.rank.hf import CallbackMixin, OrchestratorCallback

        if not any(isinstance(cb, CallbackMixin) for cb in self.callback_handler.callbacks):
            self.add_callback(OrchestratorCallback())

    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if enabled() and (resume_from_checkpoint is None or resume_from_checkpoint is True):
            from orchestrator.rank.hf import (
                CallbackMixin,
                last_complete_checkpoint,
                refuse_foreign_checkpoints,
            )

            # Before anything is chosen or written: never train over another run's checkpoints.
            refuse_foreign_checkpoints(self.args.output_dir)
            # True would make Transformers take its newest checkpoint-N, torn or not.
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            for cb in self.callback_handler.callbacks:
                if isinstance(cb, CallbackMixin):
                    cb.resumed_from = resume_from_checkpoint
                    cb.guarded = True
        return original_train(self, resume_from_checkpoint, *args, **kwargs)

    def save_model(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # The user's call only: a checkpoint's model files are the sharded state the Trainer restores.
        if enabled() and not _internal_call and getattr(self, "is_fsdp_enabled", False):
            from orchestrator.rank.hf import save_full_model

            if save_full_model(self, output_dir):
                if self.args.push_to_hub:
                    self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
                return
        original_save_model(self, output_dir, _internal_call)

    def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # A stop signal (TERM) reaches every process of the step, the script's reporting services too:
        # wandb's service dies of it, and a log call on the way to the agreed save then raises in the
        # rank (ConnectionResetError), which loses the save. From the moment this rank heard the signal,
        # a log reaches orchestrator's callback only (metrics.jsonl); log_history keeps it as usual.
        from orchestrator.rank.hf import CallbackMixin

        everyone = self.callback_handler.callbacks
        ours = [cb for cb in everyone if isinstance(cb, CallbackMixin)]
        if not enabled() or not any(cb.stop.signum for cb in ours):
            original_log(self, logs, *args, **kwargs)
            return
        self.callback_handler.callbacks = ours
        try:
            original_log(self, logs, *args, **kwargs)
        finally:
            self.callback_handler.callbacks = everyone

    cls.__init__ = __init__
    cls.train = train
    cls.save_model = save_model
    cls.log = log
    cls._orchestrator_patched = True


def in_code_plugin_cause(accelerator: Any, exp: Any) -> str | None:
    """Why a launch that asked for no FSDP runs FSDP when the script passed ``Accelerator(fsdp_plugin=...)``:
    Accelerate lets a plugin built in code override the launch config. The cause and the two fixes."""
    if accelerator.distributed_type.value != "FSDP" or exp.strategy is None or exp.strategy not in STRATEGIES:
        return None
    if STRATEGIES[exp.strategy].uses_fsdp:
        return None
    return (
        f"cause: the script passes its own FSDP plugin (Accelerator(fsdp_plugin=...)), and Accelerate lets a "
        f"plugin in code override the launch ({exp.strategy}). Submit with --strategy full_shard (or another "
        f"FSDP strategy) to shard with it, or drop fsdp_plugin= from Accelerator(...) to train as {exp.strategy}"
    )


def _run_dir() -> str | None:
    return os.environ.get(RUN_DIR_ENV)


#: Module name -> patch, for the import hook.
PATCHES = {"accelerate.accelerator": patch_accelerator, "transformers.trainer": patch_trainer}
