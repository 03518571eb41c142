"""Run by tests/rank/test_memory_checkpoints.py under torchrun (2 ranks, FSDP2 through Accelerate
on CPU): the tiny model, AdamW and an LR schedule; a memory checkpoint of step 3
(``orchestrator.rank.memory_checkpoints``) into ``$ORCHESTRATOR_MEMORY_CKPT_DIR``, then steps 4 and
5, then a restore of step 3 in the same processes.

``fit OUT``: the restore is taken; ``corrupt OUT``: rank 1's file is cut short first, and the
restore must be refused on both ranks with nothing changed on either; ``open OUT``: the folder's
parent is writable by everyone, so nothing is saved (memory checkpoints off) and nothing restored.
``ddp OUT`` (launched without FSDP): the same restore under DDP, where rank 1's file leaves the
parameters and optimizer state to rank 0's; after it, rank 0's file is removed, and then rank 1 has no
whole memory checkpoint: no common step is found (``common_without_rank_0``). ``auto OUT``: ``every="auto"`` with a
shared interval of 50: steps 1-8 through ``due``/``save``; the interval it chose, what it measured,
this rank's own save and the steps saved. ``nodes-save`` / ``nodes-swap``: nodes of one rank
each, copies on another node, and a restore after spares took lost nodes' places (:func:`nodes`).
``result_<rank>.json`` says the step found, the refusal, whether the state equals step 3's (or step
5's, untouched), and step 4's loss the first time and once more after the restore.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

# The state's copy and comparison of the shard-plan probe (this folder is the script's sys.path[0]).
from shard_plan_probe import same
from shard_plan_probe import snapshot as tensors

from orchestrator.contract.memory_checkpoints import memory_ckpt_file
from orchestrator.rank import workarounds
from orchestrator.rank.memory_checkpoints import MemoryCheckpoints
from orchestrator.rank.run_script import leave
from train.model import build_model


def step(acc: Any, model: Any, opt: Any, sched: Any, n: int) -> float:
    g = torch.Generator().manual_seed(1000 * n + acc.process_index)
    noise = float(torch.rand(()))  # the global RNG: a restore that misses it changes the loss
    out = model(torch.randint(0, 256, (2, 16), generator=g))
    loss = (out[0] if isinstance(out, tuple) else out).float().pow(2).mean() * (1 + noise)
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.detach())


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    from accelerate import Accelerator

    pending = workarounds.before_accelerator()
    acc = Accelerator()
    workarounds.after_accelerator(acc, pending)
    model = workarounds.wrap_model(acc, build_model("tiny"), pending)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.register_for_checkpointing(sched)
    rank = acc.process_index
    if mode == "auto":
        auto(acc, model, opt, sched, out)
        return
    if mode.startswith("nodes-"):
        nodes(mode, acc, model, opt, sched, out)
        return
    snaps = MemoryCheckpoints(acc, every=3)
    losses = {n: step(acc, model, opt, sched, n) for n in (1, 2, 3)}
    if mode == "open" and rank == 0:  # another user could write where the checkpoints go
        parent = Path(os.environ["ORCHESTRATOR_MEMORY_CKPT_DIR"]).parent
        parent.mkdir(parents=True, exist_ok=True)
        parent.chmod(0o777)
    torch.distributed.barrier()
    snaps.save(3)
    at_3 = tensors(model, opt)
    epochs = {3: sched.state_dict()["last_epoch"]}
    losses.update({n: step(acc, model, opt, sched, n) for n in (4, 5)})
    at_5 = tensors(model, opt)
    epochs[5] = sched.state_dict()["last_epoch"]
    folder = Path(os.environ["ORCHESTRATOR_MEMORY_CKPT_DIR"])
    torch.distributed.barrier()
    sizes = [memory_ckpt_file(folder, 2, r, 3).stat().st_size for r in (0, 1)] if mode != "open" else []
    torch.distributed.barrier()
    if mode == "corrupt" and rank == 1:
        path = memory_ckpt_file(folder, 2, 1, 3)
        path.write_bytes(path.read_bytes()[:100])
    torch.distributed.barrier()
    common = snaps.common_step()
    refused = snaps.restore(common) if common is not None else "no common step"
    result = {
        "common": common,
        "refused": refused,
        "file_bytes": sizes,
        "equals_step_3": same(tensors(model, opt), at_3),
        "equals_step_5": same(tensors(model, opt), at_5),
        "sched_is_step": next((n for n, e in epochs.items() if e == sched.state_dict()["last_epoch"]), None),
        "loss_4": losses[4],
        "loss_4_again": step(acc, model, opt, sched, 4) if refused is None else None,
    }
    if mode == "ddp":  # the node's first rank's file lost: rank 1's alone is not a memory checkpoint
        torch.distributed.barrier()
        if rank == 0:
            memory_ckpt_file(folder, 2, 0, 3).unlink()
        torch.distributed.barrier()
        result["common_without_rank_0"] = snaps.common_step()
    (out / f"result_{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


def auto(acc: Any, model: Any, opt: Any, sched: Any, out: Path) -> None:
    snaps = MemoryCheckpoints(acc, every="auto", shared_every=50)
    own_save, saved = None, []
    for n in range(1, 9):
        step(acc, model, opt, sched, n)
        if acc.process_index == 1:
            time.sleep(0.05)  # the slower rank: its step time is the one that counts
        if snaps.due(n):
            seconds = snaps.save(n)
            own_save = seconds if own_save is None else own_save
            saved.append(n)
    result = {"every": snaps.every, "measured": snaps.measured, "own_save": own_save, "saved": saved}
    (out / f"result_{acc.process_index}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


def nodes(mode: str, acc: Any, model: Any, opt: Any, sched: Any, out: Path) -> None:
    """Nodes of one rank. ``nodes-save``: steps 1-3 with memory checkpoints of steps 2 and 3 (each
    copied to another node), step 3's state kept in ``at_3_<rank>.pt``, then step 4's loss. ``nodes-swap``
    (new processes; the test gave the first nodes the surviving nodes' folders and the others empty
    ones, spares'): the restore of the newest step, whose state and step 4's loss must be ``nodes-save``'s."""
    rank = acc.process_index
    snaps = MemoryCheckpoints(acc, every=0)
    result: dict[str, Any] = {"linked": snaps.link is not None}
    if mode == "nodes-save":
        for n in (1, 2, 3):
            step(acc, model, opt, sched, n)
            if n >= 2:
                snaps.save(n)
        torch.save(tensors(model, opt), out / f"at_3_{rank}.pt")
        if snaps.link is not None:
            snaps.link.wait()  # the copy goes on beside training: this probe ends right after it
        result["received_bytes"] = snaps.link.received_bytes if snaps.link else 0
    else:
        result["common"] = snaps.common_step()
        result["refused"] = snaps.restore(result["common"]) if result["common"] is not None else "none"
        result["equals_step_3"] = same(
            tensors(model, opt), torch.load(out / f"at_3_{rank}.pt", weights_only=False)
        )
    result["loss_4"] = step(acc, model, opt, sched, 4)
    (out / f"{mode}_{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    leave(0)  # as every rank the product starts: no gloo teardown at the interpreter's exit
