"""Resume, requeue and live progress for a Hugging Face ``Trainer`` script: one line each.

::

    from orchestrator.hf import OrchestratorCallback, last_complete_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[OrchestratorCallback()])
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))

The public names; the code runs in the ranks and lives in :mod:`orchestrator.rank.hf`.
Standard library only at import: ``OrchestratorCallback`` (a ``TrainerCallback``) is built on first use.
"""

from __future__ import annotations

from typing import Any

from orchestrator.rank import hf as _impl
from orchestrator.rank.hf import last_complete_checkpoint

__all__ = ["OrchestratorCallback", "last_complete_checkpoint"]  # noqa: F822 (built on first use)


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)
