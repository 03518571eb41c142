"""Run by tests/rank/test_shard_plan.py under torchrun (2 ranks, FSDP2 through Accelerate on CPU): the
tiny model, AdamW and an LR schedule, saved with train/'s save and loaded back with train/'s load.

``save OUT``: 3 steps, save (step 3), 2 steps, save (step 5), each with a snapshot of every rank's
local tensors and param groups (``snap_<step>_<rank>.pt``); then, in the same processes, a load of
step 3 through the load plan and one more step, and the same through DCP's own path (no plan):
``warm_<rank>.json`` says which path each took, whether the state equals the snapshot, and both
steps' losses.

``resume OUT``: fresh processes, as a resumed attempt: rank 0 picks with ``find_resumable(...,
shards=False)``, every rank checks its own shards (``checked_choice``), then the load: ``resume_<rank>.json``
(the step chosen, the path taken, equality with that step's snapshot, the next step's loss).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.contract.checkpoints import find_resumable
from orchestrator.rank import shard_plan, workarounds
from orchestrator.rank.checkpoint_io import checked_choice
from orchestrator.rank.run_script import leave
from train import checkpointing
from train.model import build_model


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model: Any, opt: Any) -> dict:
    inner = opt.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: local(p) for n, p in model.named_parameters()},
        "state": {names[id(p)]: {k: local(v) for k, v in st.items()} for p, st in inner.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
    }


def same(a: dict, b: dict) -> bool:
    return (
        a["params"].keys() == b["params"].keys()
        and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        and a["state"].keys() == b["state"].keys()
        and all(
            a["state"][n].keys() == b["state"][n].keys()
            and all(torch.equal(a["state"][n][k], b["state"][n][k]) for k in a["state"][n])
            for n in a["state"]
        )
        and a["groups"] == b["groups"]
    )


def step(acc: Any, model: Any, opt: Any, sched: Any, n: int) -> float:
    g = torch.Generator().manual_seed(1000 * n + acc.process_index)
    out = model(torch.randint(0, 256, (2, 16), generator=g))
    loss = (out[0] if isinstance(out, tuple) else out).float().pow(2).mean()
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.detach())


@contextlib.contextmanager
def recorded() -> Any:
    """The load plan's report of every load inside."""
    real = shard_plan.fast_fsdp_loads
    got: dict[str, Any] = {}

    @contextlib.contextmanager
    def wrapped(folder: Path) -> Any:
        with real(folder) as report:
            yield report
        got.update(
            model=report.model, optimizer=report.optimizer, tensors=report.tensors, why_not=report.why_not
        )

    shard_plan.fast_fsdp_loads = wrapped  # type: ignore[assignment]
    try:
        yield got
    finally:
        shard_plan.fast_fsdp_loads = real  # type: ignore[assignment]


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
    rank = acc.process_index
    current = {"world_size": acc.num_processes, "strategy": "full_shard"}
    run_dir = out / "run"
    if mode == "save":
        for n in range(1, 6):
            step(acc, model, opt, sched, n)
            if n in (3, 5):
                checkpointing.save(acc, run_dir, n, dict(current), keep_last=2)
                torch.save(snapshot(model, opt), out / f"snap_{n}_{rank}.pt")
        folder = run_dir / "checkpoints" / checkpointing.step_name(3)
        want = torch.load(out / f"snap_3_{rank}.pt")
        with recorded() as fast:
            checkpointing.load(acc, folder, dict(current), opt, current)
        fast_equal = same(snapshot(model, opt), want)
        fast_loss = step(acc, model, opt, sched, 6)
        with recorded() as stock:
            real = shard_plan.fast_fsdp_loads
            shard_plan.fast_fsdp_loads = lambda folder: contextlib.nullcontext(shard_plan.FastLoadReport())  # type: ignore[assignment]
            try:
                checkpointing.load(acc, folder, dict(current), opt, current)
            finally:
                shard_plan.fast_fsdp_loads = real  # type: ignore[assignment]
        stock_equal = same(snapshot(model, opt), want)
        stock_loss = step(acc, model, opt, sched, 6)
        result = {"fast": fast, "fast_equal": fast_equal, "fast_loss": fast_loss, "stock": stock,
                  "stock_equal": stock_equal, "stock_loss": stock_loss}  # fmt: skip
        (out / f"warm_{rank}.json").write_text(json.dumps(result))
    else:
        choice: list[Any] = [None]
        if rank == 0:
            found = find_resumable(run_dir, lambda line: print(line, flush=True), shards=False)
            choice = [(str(found[0]), found[1]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        checked = checked_choice(acc, run_dir, choice[0], lambda line: print(line, flush=True))
        result = {"picked": None if choice[0] is None else Path(choice[0][0]).name}
        if checked is not None:
            folder = Path(checked[0])
            with recorded() as fast:
                checkpointing.load(acc, folder, checked[1], opt, current)
            n = int(folder.name.removeprefix("step_"))
            result.update(
                checked=folder.name,
                fast=fast,
                equal=same(snapshot(model, opt), torch.load(out / f"snap_{n}_{rank}.pt")),
                loss=step(acc, model, opt, sched, 6),
            )
        (out / f"resume_{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
    # As every rank the product starts (run_script.leave): torch 2.13's gloo teardown at the
    # interpreter's exit aborted rank 0 once in a CI run ("terminate called without an active exception").
    leave(0)
