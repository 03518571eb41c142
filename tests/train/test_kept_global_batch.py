"""``train/`` after the job shrank (``on_node_loss: shrink``): as many samples per optimizer step as the
run started with, by accumulating over more micro-batches. The cluster's side:
tests/cluster/test_restart_in_allocation.py."""

from __future__ import annotations

import pytest


def test_train_keeps_the_global_batch_after_a_shrink(monkeypatch: pytest.MonkeyPatch) -> None:
    from train.train import kept_grad_accum

    assert kept_grad_accum(2, 4) == 2
    monkeypatch.setenv("ORCHESTRATOR_BATCH_WORLD_SIZE", "4")
    assert kept_grad_accum(2, 2) == 4 and kept_grad_accum(1, 1) == 4 and kept_grad_accum(3, 4) == 3
    with pytest.raises(SystemExit, match="does not divide"):
        kept_grad_accum(1, 3)
