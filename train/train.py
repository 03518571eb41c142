"""Reference training program: a byte-level GPT under Accelerate, every strategy, CPU or GPU.

Run through ``accelerate launch --config_file <rendered config> train/train.py ...``
(the orchestrator renders the config and sets the environment). See
``python train/train.py --help``.

Environment contract:

* in: ``ORCHESTRATOR_RUN_DIR`` (default run dir), ``ORCHESTRATOR_EXPECTED_WORLD_SIZE``,
  ``ORCHESTRATOR_EXPECTED_NUM_NODES``, ``ORCHESTRATOR_PROCS_PER_NODE``,
  ``ORCHESTRATOR_STRATEGY``, ``ORCHESTRATOR_FSDP_VERSION`` (self-check expectations),
  ``ACCELERATE_USE_CPU=1`` on CPU machines; ``ORCHESTRATOR_DISABLE_WORKAROUNDS`` (tests only).
* exit codes (of every training process): 0 done (max steps or time budget), 3 self-check
  failed, 4 a restored checkpoint does not match its checksums, 75 (EX_TEMPFAIL) stopped on
  SIGUSR2/SIGTERM after saving a checkpoint: requeue me. ``accelerate launch`` (torchrun)
  turns any non-zero worker exit into its own exit 1, so rank 0 also writes
  ``<run_dir>/exit_status.json`` ``{"code", "reason", "step", "time"}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if __package__ in (None, ""):
    # Run as a script (accelerate launch train/train.py): make `import train.x` work.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from orchestrator.contract import checkpoints
from orchestrator.contract.attempt_start import write_attempt_start
from orchestrator.contract.env import BATCH_WORLD_SIZE_ENV, RUN_DIR_ENV, SCRIPT_HOOKS_ENV, STRATEGY_ENV

# Exit codes and the exit-status file: the run directory's contract with the launcher.
from orchestrator.contract.heartbeat import Heartbeat
from orchestrator.contract.memory_checkpoints import parse_memory_ckpt_every
from orchestrator.contract.run_dir import EXIT_BAD_RESTORE, EXIT_OK, EXIT_REQUEUE, write_exit_status
from orchestrator.rank import selfcheck
from orchestrator.rank import workarounds as accelerate_workarounds
from orchestrator.rank.checkpoint_io import checked_choice
from orchestrator.rank.loop import fix_ddp_buckets
from orchestrator.rank.memory_checkpoints import MemoryCheckpoints, why_not_supported
from train import checkpointing, deepspeed_zero
from train.checksum import MAX_PARAMS_FOR_CHECKSUM
from train.checksum import checksums as _checksums
from train.checksum import local_shard_checksum as _local_shard_checksum
from train.data import Batcher, make_source
from train.metrics import Metrics, process_start_time
from train.model import build_model, count_params

if TYPE_CHECKING:
    from accelerate import Accelerator

_STOP_SIGNAL = {"signum": 0}
#: The time budget's check takes the median of this many latest step times (a bounded window: sorting
#: every step time so far at every step grew with the run).
RECENT_STEPS = 100


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    # Only set a flag: the step loop agrees on stopping, then checkpoints. Never save here. The line
    # says which rank heard it (the per-rank logs show whether a relay reached every worker).
    _STOP_SIGNAL["signum"] = signum
    rank = os.environ.get("RANK", "?")
    print(f"[rank {rank}] received {signal.Signals(signum).name}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=["tiny", "small", "base", "1b"], default="tiny")
    p.add_argument("--data", choices=["text", "synthetic"], default="text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="per process, per micro-step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm (0: off)")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds; stop (and checkpoint) before it runs out; 0: none",
    )
    p.add_argument("--eval-every", type=int, default=0, help="steps; 0: only at the end")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=0, help="steps; 0: only at the end")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--async-ckpt", action="store_true")
    p.add_argument(
        "--memory-ckpt-every",
        type=parse_memory_ckpt_every,
        default=0,
        help="steps, or auto (measured: at most 2%% of training time); each rank's state into node "
        "memory, for restarts in place; 0: none",
    )
    p.add_argument("--run-dir", default=None, help="default: $ORCHESTRATOR_RUN_DIR or ./runs/<timestamp>")
    p.add_argument(
        "--resume", default="auto", help="auto (newest complete checkpoint in the run dir) | never | PATH"
    )
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "grad_accum", "max_steps", "keep_last", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1")
    return args


def kept_grad_accum(grad_accum: int, world: int) -> int:
    """``--grad-accum`` at this world size, keeping the global batch the run was started with
    (:data:`BATCH_WORLD_SIZE_ENV`, set when the job shrank); unchanged otherwise."""
    raw = os.environ.get(BATCH_WORLD_SIZE_ENV, "")
    if not raw.isdigit() or int(raw) <= world:
        return grad_accum
    if int(raw) % world:
        raise SystemExit(f"{BATCH_WORLD_SIZE_ENV}={raw}: world size {world} does not divide it")
    kept = grad_accum * int(raw) // world
    print(
        f"world size {world} after a shrink (the run started at {raw}): --grad-accum {grad_accum} -> {kept}, "
        "the global batch kept",
        file=sys.stderr,
        flush=True,
    )
    return kept


def lr_lambda(warmup: int, max_steps: int) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine down to 0.1 at max_steps (multiplier of --lr)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def strategy_from_state(accelerator: Accelerator) -> tuple[str, int | None]:
    """The strategy as actually running (for metrics and markers)."""
    env_strategy = os.environ.get(STRATEGY_ENV)
    if deepspeed_zero.active(accelerator):
        return f"deepspeed_zero{deepspeed_zero.zero_stage(accelerator)}", None
    if accelerator.distributed_type.value != "FSDP":
        return ("ddp" if accelerator.num_processes > 1 else "single"), None
    version = accelerator.state.fsdp_plugin.fsdp_version
    if env_strategy:
        return env_strategy, version
    guessed, _ = selfcheck._strategy_from_accelerate_env(dict(os.environ))
    return guessed or "fsdp", version


def resolve_run_dir(args: argparse.Namespace, accelerator: Accelerator) -> Path:
    chosen = args.run_dir or os.environ.get(RUN_DIR_ENV)
    if not chosen:
        chosen = str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    value = [chosen]
    if accelerator.num_processes > 1:
        dist.broadcast_object_list(value, src=0)  # one run dir even if the clocks ticked apart
    return Path(value[0]).resolve()


def mean_over_ranks(accelerator: Accelerator, value: float, *flags: bool) -> tuple[float, ...]:
    """The mean of ``value`` over ranks, and each flag true on any rank, in one small all_reduce.

    Why one: the step's loss is reduced anyway, and the ranks' stop agreement (a signal on any rank,
    the time budget) rides along in the same SUM instead of a second collective at every step
    boundary (bench/bench_step_boundary.py)."""
    t = torch.tensor([value, *map(float, flags)], dtype=torch.float64)
    if accelerator.num_processes > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t[0] /= accelerator.num_processes
    mean, *anywhere = t.tolist()
    return (mean, *(float(f > 0) for f in anywhere))


def checksums(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_params: int
) -> dict[str, float | None]:
    """A collective: full-state checksums, gathered the way the running strategy needs."""
    if num_params <= MAX_PARAMS_FOR_CHECKSUM and type(model).__name__ == "DeepSpeedEngine":
        return deepspeed_zero.checksums(model, optimizer)
    return _checksums(model, optimizer, num_params)


def local_shard_checksum(model: torch.nn.Module) -> float:
    if type(model).__name__ == "DeepSpeedEngine":
        return deepspeed_zero.local_shard_checksum(model)
    return _local_shard_checksum(model)


def write_json(path: Path, data: dict) -> None:
    # A temp name per process: in a broken launch every process believes it is rank 0 and writes the
    # same files at once; with one shared temp name their bytes interleaved (measured: "Extra data").
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def evaluate(accelerator: Accelerator, model: torch.nn.Module, batcher: Batcher, n_batches: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(n_batches):
            x, y = batcher.val_batch(i)
            with accelerator.autocast():
                total += float(model(x.to(accelerator.device), y.to(accelerator.device)))
    model.train()
    return mean_over_ranks(accelerator, total / n_batches)[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    # This program makes the self-check and workaround calls itself: the node's script hooks stand aside.
    os.environ[SCRIPT_HOOKS_ENV] = "0"
    signal.signal(signal.SIGUSR2, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    for message in (
        ".*FSDP.state_dict_type.*",
        ".*sharding_strategy is deprecated.*",
        ".*Multiple backends are registered with this ProcessGroup.*",
        ".*ShardedTensor.*",
        ".*torch.distributed.checkpoint.*experimental.*",
        ".*TypedStorage is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=message)

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    # Start-up split (bench/bench_startup.py): the interpreter's start, then each stage's end.
    stamps = {"process": process_start_time(), "imports": time.time()}

    try:
        expectation = selfcheck.expectations_from_env()
    except selfcheck.SelfCheckError as exc:
        unknown = selfcheck.Expectation(source="the environment")
        selfcheck.fail([str(exc)], unknown, "", None, int(os.environ.get("RANK", "0") or 0))
    pending = accelerate_workarounds.before_accelerator()
    accelerator = Accelerator(
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=".", automatic_checkpoint_naming=False),
    )
    accelerate_workarounds.after_accelerator(accelerator, pending)
    stamps["process_group"] = time.time()
    rank = accelerator.process_index
    world = accelerator.num_processes
    # After the job shrank (a node lost, on_node_loss: shrink), as many samples per optimizer step as
    # the run was started with: more micro-batches per step on fewer ranks.
    args.grad_accum = kept_grad_accum(args.grad_accum, world)
    # Step and phase for the hang watchdog and straggler detection (None outside orchestrator).
    heartbeat = Heartbeat.for_this_rank()
    beat = heartbeat.beat if heartbeat is not None else (lambda step, phase: None)

    # Self-check, phase 1: before anything is built.
    problems = selfcheck.check_launch(accelerator, expectation)
    run_dir_hint = args.run_dir or os.environ.get(RUN_DIR_ENV)
    if problems:
        selfcheck.fail(
            problems,
            expectation,
            f"world size {world}, distributed type {accelerator.distributed_type.value}",
            run_dir_hint,
            rank,
        )

    run_dir = resolve_run_dir(args, accelerator)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.project_dir = str(run_dir)
    accelerator.project_configuration.logging_dir = str(run_dir / "tensorboard")

    strategy, fsdp_version = strategy_from_state(accelerator)

    # Model, optimizer, schedule.
    gpt = build_model(args.preset, args.seq_len, seed=args.seed)
    num_params = count_params(gpt)
    if args.seq_len > gpt.cfg.max_seq_len:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the preset's context {gpt.cfg.max_seq_len}")
    model = accelerate_workarounds.wrap_model(accelerator, gpt, pending)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )
    torch_optimizer = optimizer
    deepspeed = deepspeed_zero.active(accelerator)
    if deepspeed:
        for note in deepspeed_zero.configure(accelerator, args.batch_size, args.grad_accum, args.clip):
            if accelerator.is_main_process:
                print(note, file=sys.stderr, flush=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # DDP's final gradient buckets before the first step of every attempt: at 3+ ranks a resumed run's
    # first step otherwise reduces in the initial layout and the run drifts by the last bit.
    fix_ddp_buckets(accelerator)
    # Not prepared: a prepared scheduler steps once per process; the step count is ours to keep. Under
    # DeepSpeed the prepared optimizer wraps ZeRO's (no torch Optimizer), which steps the AdamW built
    # above on its own param groups: schedule that one.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch_optimizer if deepspeed else optimizer.optimizer, lr_lambda(args.warmup_steps, args.max_steps)
    )
    train_state = checkpointing.TrainState(
        world_size=world,
        strategy=strategy,
        fsdp_version=fsdp_version,
        seed=args.seed,
        data=args.data,
        preset=args.preset,
    )
    accelerator.register_for_checkpointing(scheduler)
    accelerator.register_for_checkpointing(train_state)

    # Self-check, phase 2: the wrapping really happened, with the expected groups.
    problems, found = selfcheck.check_model(accelerator, model, expectation, num_params)
    if problems:
        selfcheck.fail(problems, expectation, found, str(run_dir), rank)
    if accelerator.is_main_process:
        applied = ", ".join(pending.applied) or "none"
        print(
            f"self-check ok: {expectation.describe()} ({found}); workarounds applied: {applied}; "
            f"{num_params / 1e6:.2f}M parameters; device {accelerator.device}; run dir {run_dir}",
            flush=True,
        )

    source = make_source(args.data)
    batcher = Batcher(source, args.seed, args.seq_len, args.batch_size, world, rank, args.grad_accum)
    stamps["model"] = time.time()
    metrics = Metrics(accelerator, run_dir, args.max_steps, world, strategy, args.log_every)
    metrics.startup(stamps)
    if accelerator.is_main_process:
        accelerator.init_trackers(
            "train", config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        )

    # Resume.
    def warn(line: str) -> None:
        if accelerator.is_main_process:
            print(line, file=sys.stderr, flush=True)

    choice: list = [None]
    if accelerator.is_main_process and args.resume != "never":
        found_ckpt: tuple[Path, dict] | tuple[str, str] | None
        if args.resume == "auto":
            found_ckpt = checkpoints.find_resumable(run_dir, warn, shards=False)  # ranks: below
        else:
            folder = Path(args.resume)
            marker, why = checkpointing.validate(folder)
            if marker is None:
                print(f"--resume {folder}: not a complete checkpoint: {why}", file=sys.stderr, flush=True)
                found_ckpt = ("invalid", why)
            else:
                found_ckpt = (folder, marker)
        choice = [(str(found_ckpt[0]), found_ckpt[1]) if found_ckpt else None]
    if world > 1:
        dist.broadcast_object_list(choice, src=0)
    memory_ckpts = None
    if args.memory_ckpt_every != 0:
        unsupported = why_not_supported(accelerator)
        if unsupported:
            warn(f"note: --memory-ckpt-every: {unsupported}")
        else:
            memory_ckpts = MemoryCheckpoints(
                accelerator, args.memory_ckpt_every, shared_every=args.ckpt_every
            )
    from_memory = None
    if memory_ckpts is not None and args.resume == "auto":
        # Held by every rank (a restart in place: the same nodes) and as new as the shared checkpoint
        # or newer: the same step is read from memory, not from the shared file system.
        shared_step = int(choice[0][1].get("step", -1)) if choice[0] is not None else -1
        t0 = time.monotonic()
        common = memory_ckpts.common_step()
        if common is not None and common >= shared_step:
            failed = memory_ckpts.restore(common)
            if failed is None:
                from_memory = (common, time.monotonic() - t0)
            else:
                warn(f"warning: the memory checkpoint of step {common} was not restored ({failed})")
    if args.resume == "auto" and choice[0] is not None and from_memory is None:
        choice = [checked_choice(accelerator, run_dir, choice[0], warn)]  # every rank: its own shards
    last_saved_step = -1
    if choice[0] is not None and choice[0][0] == "invalid":
        return 2
    if from_memory is not None:
        # The shared checkpoint (older) stays the one a stop would not save again.
        last_saved_step = int(choice[0][1].get("step", -1)) if choice[0] is not None else -1
        _resumed_from_memory(accelerator, run_dir, metrics, model, optimizer, num_params, *from_memory)
    elif choice[0] is not None:
        folder, marker = Path(choice[0][0]), choice[0][1]
        refusal = deepspeed_zero.resume_problem(marker, strategy, world)
        if refusal:
            warn(f"error: cannot resume from {folder}: {refusal}")
            if accelerator.is_main_process:
                write_exit_status(
                    run_dir, EXIT_BAD_RESTORE, "checkpoint cannot be resumed", problems=[refusal]
                )
            return EXIT_BAD_RESTORE
        t0 = time.monotonic()
        notes = checkpointing.load(
            accelerator, folder, marker, optimizer, {"strategy": strategy, "world_size": world}
        )
        load_s = time.monotonic() - t0
        sums = checksums(model, optimizer, num_params)
        for note in notes:
            warn(f"warning: {note}")
        bad: list[str] = []
        # ZeRO's optimizer checksum sums each rank's flat partition: comparable at the same world size only.
        resharded_zero = deepspeed and int(marker.get("world_size", world)) != world
        for k in ("param_checksum",) if resharded_zero else ("param_checksum", "optim_checksum"):
            saved, restored = marker.get(k), sums[k]
            if (
                saved is not None
                and restored is not None
                and not math.isclose(saved, restored, rel_tol=1e-12, abs_tol=1e-12)
            ):
                bad.append(f"{k}: checkpoint says {saved!r}, restored {restored!r}")
        if accelerator.is_main_process:
            write_json(
                run_dir / "loaded.json",
                {
                    "step": train_state.step,
                    "checkpoint": str(folder),
                    "world_size": world,
                    "load_s": load_s,
                    **sums,
                },
            )
            metrics.resume(train_state.step, str(folder))
            print(f"resumed from {folder} at step {train_state.step} in {load_s:.2f}s", flush=True)
        if bad:
            warn("error: the restored state does not match the checkpoint: " + "; ".join(bad))
            if accelerator.is_main_process:
                write_exit_status(run_dir, EXIT_BAD_RESTORE, "restore mismatch", problems=bad)
            return EXIT_BAD_RESTORE
        last_saved_step = train_state.step
        train_state.world_size = world
        train_state.strategy = strategy
        train_state.fsdp_version = fsdp_version
    if accelerator.is_main_process and from_memory is None:
        write_attempt_start(
            train_state.step, choice[0][0] if choice[0] is not None else None, "train", run_dir
        )

    async_ckpt = (
        checkpointing.AsyncCheckpointer(
            accelerator, run_dir, args.keep_last, want_checksums=num_params <= MAX_PARAMS_FOR_CHECKSUM
        )
        if args.async_ckpt and not deepspeed  # the async writer stages FSDP/DDP state dicts only
        else None
    )

    def save_checkpoint(step: int) -> float:
        """All ranks; returns seconds spent blocking training."""
        nonlocal last_saved_step
        beat(step, "checkpoint")
        t0 = time.monotonic()
        marker = {
            "world_size": world,
            "strategy": strategy,
            "fsdp_version": fsdp_version,
            "samples_seen": train_state.samples_seen,
        }
        if async_ckpt is not None:
            # Checksums are computed by the writer thread from the staged/written state (measured: the
            # gather + float64 pass here was most of the async stall).
            if num_params > MAX_PARAMS_FOR_CHECKSUM:
                marker.update(param_checksum=None, optim_checksum=None)
            report_async(
                async_ckpt.wait()
            )  # one save in flight: the previous one, reported, not reaped silently
            async_ckpt.start(model, optimizer, step, marker)
        else:
            marker.update(checksums(model, optimizer, num_params))
            result = checkpointing.save(accelerator, run_dir, step, marker, args.keep_last)
            if accelerator.is_main_process:
                split = ", ".join(f"{k} {v:.2f}s" for k, v in result.phases.items())
                metrics.say(f"checkpoint step {step} saved in {result.seconds:.2f}s: {result.path} ({split})")
        last_saved_step = step
        return time.monotonic() - t0

    def report_async(result: checkpointing.SaveResult | None) -> None:
        if result is not None:
            metrics.say(
                f"checkpoint step {result.step} complete (async, {result.seconds:.2f}s): {result.path}"
            )

    # Train.
    model.train()
    tokens_per_step = batcher.global_batch * args.seq_len
    recent_step_times: deque[float] = deque(maxlen=RECENT_STEPS)
    stop_reason = None
    loss_value = train_state.last_loss
    first_step = train_state.step + 1

    def out_of_time() -> bool:
        """Would the next step (twice the recent median, plus a second) overrun the time budget?"""
        if not args.time_budget:
            return False
        typical = statistics.median(recent_step_times) if recent_step_times else 0.0
        return time.monotonic() - t_start + 2 * typical + 1.0 > args.time_budget

    # Every rank agrees whether to stop (a signal on any rank, or the time budget): here once for a
    # signal that came during start-up, then at the end of every step, with its loss.
    _, signalled, timed_out = mean_over_ranks(accelerator, 0.0, _STOP_SIGNAL["signum"] != 0, out_of_time())
    while True:
        if async_ckpt is not None:
            report_async(async_ckpt.poll())
        beat(train_state.step + 1, "data")
        if signalled:
            stop_reason = "signal"
            break
        if train_state.step >= args.max_steps:
            stop_reason = "max_steps"
            break
        if timed_out:
            stop_reason = "time_budget"
            break

        step = train_state.step + 1
        t0 = time.monotonic()
        loss_sum = 0.0
        for micro in range(args.grad_accum):
            x, y = batcher.train_batch(train_state.samples_seen, micro)
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            sync = micro == args.grad_accum - 1
            with nullcontext() if sync else accelerator.no_sync(model):
                beat(step, "forward")
                with accelerator.autocast():
                    loss = model(x, y)
                beat(step, "backward")
                accelerator.backward(loss / args.grad_accum)
            loss_sum += float(loss.detach())
            if micro < args.grad_accum - 1:
                beat(step, "data")
        beat(step, "optimizer")
        grad_norm = accelerator.clip_grad_norm_(
            model.parameters(), args.clip if args.clip > 0 else float("inf")
        )
        if deepspeed:  # the engine clipped and stepped inside backward; this is its norm
            grad_norm = deepspeed_zero.grad_norm(accelerator, grad_norm)
        # A float already (LambdaLR over a float lr); float() because the stub also allows a Tensor.
        lr = float(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_state.step = step
        train_state.samples_seen += batcher.global_batch
        loss_value, signalled, timed_out = mean_over_ranks(
            accelerator, loss_sum / args.grad_accum, _STOP_SIGNAL["signum"] != 0, out_of_time()
        )
        train_state.last_loss = loss_value
        step_time = time.monotonic() - t0
        recent_step_times.append(step_time)
        metrics.train(step, loss_value, lr, float(grad_norm), tokens_per_step, step_time)

        if args.eval_every and step % args.eval_every == 0:
            metrics.eval(step, evaluate(accelerator, model, batcher, args.eval_batches))
        if memory_ckpts is not None and memory_ckpts.due(step):
            # Before a shared checkpoint of the same step: once that one is complete, every rank
            # holds this one too, and a restart in place never goes back further than the shared one.
            beat(step, "checkpoint")
            memory_ckpts.save(step)
            if memory_ckpts.worth_saying(step):
                said = f"memory checkpoint step {step}: {memory_ckpts.last_seconds:.3f}s"
                if memory_ckpts.link is not None and memory_ckpts.link.copy_seconds:
                    said += f" (the last copy to another node: {memory_ckpts.link.copy_seconds:.3f}s, beside training)"
                metrics.say(said)
        if args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(step)

    step = train_state.step
    if stop_reason == "signal":
        if last_saved_step != step:
            save_checkpoint(step)
        if async_ckpt is not None:
            report_async(async_ckpt.wait())
        if memory_ckpts is not None and memory_ckpts.link is not None:
            memory_ckpts.link.wait()  # leaving mid-copy would cut the peer's copy off
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            print(f"requeue: checkpoint step {step} saved", flush=True)
            write_exit_status(run_dir, EXIT_REQUEUE, "signal", step=step)
        metrics.close()
        accelerate_workarounds.finish(accelerator)
        return EXIT_REQUEUE

    # Normal end (max steps or time budget): evaluate, checkpoint, final checksums.
    if step >= first_step or not args.eval_every:
        metrics.eval(step, evaluate(accelerator, model, batcher, args.eval_batches))
    if last_saved_step != step:
        save_checkpoint(step)
    if async_ckpt is not None:
        report_async(async_ckpt.wait())
    if memory_ckpts is not None and memory_ckpts.link is not None:
        memory_ckpts.link.wait()
    sums = checksums(model, optimizer, num_params)
    replicas = run_dir / "replicas"
    replicas.mkdir(exist_ok=True)
    write_json(
        replicas / f"rank{rank}.json",
        {"rank": rank, "step": step, "local_param_checksum": local_shard_checksum(model)},
    )
    if accelerator.is_main_process:
        write_json(
            run_dir / "final.json",
            {
                "step": step,
                "loss": loss_value,
                "world_size": world,
                "strategy": strategy,
                "stop_reason": stop_reason,
                "samples_seen": train_state.samples_seen,
                **sums,
            },
        )
        write_exit_status(run_dir, EXIT_OK, stop_reason, step=step)
        metrics.say(f"done: step {step}, loss {loss_value}, {stop_reason}")
    metrics.close()
    accelerate_workarounds.finish(accelerator)
    return EXIT_OK


def _resumed_from_memory(
    accelerator: Accelerator,
    run_dir: Path,
    metrics: Metrics,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_params: int,
    step: int,
    seconds: float,
) -> None:
    """Says so as a shared checkpoint's resume does: ``loaded.json``, the metrics, the start record."""
    sums = checksums(model, optimizer, num_params)
    if accelerator.is_main_process:
        label = f"memory checkpoint of step {step}"
        write_json(
            run_dir / "loaded.json",
            {
                "step": step,
                "checkpoint": None,
                "memory_checkpoint": step,
                "world_size": accelerator.num_processes,
                "load_s": seconds,
                **sums,
            },
        )
        metrics.resume(step, label)
        print(f"resumed from the {label} in {seconds:.2f}s", flush=True)
        write_attempt_start(step, None, "train", run_dir, memory=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed and flushed by now (trackers, metrics, checkpoints, process group); skip the
    # interpreter teardown of torch's threads and modules, which took seconds per rank.
    os._exit(code)
