"""Planning: profile + options + command in, a checked ``LaunchPlan`` out.

Pure functions only. Every impossible combination is refused here, before any
rendering or submission, with the reason in one line; the dry run, ``render``
and ``submit`` all share this one path (torchx's split of plan and execution).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.config.budget import Budget, check_budget, parse_budget
from orchestrator.config.options import (
    TrainingOptions,
    check_option_values,
    deepspeed_only_given,
    fsdp_only_given,
    options_from_json,
)
from orchestrator.config.options import merge_options as _merge
from orchestrator.config.profile.load import ClusterProfile
from orchestrator.config.scheduler_kinds import scheduler_kind
from orchestrator.config.strategies import STRATEGIES, Strategy
from orchestrator.contract.errors import UserError

__all__ = ["LaunchPlan", "TrainingOptions", "build_plan", "check_combination", "merge_options"]

#: Processes per node on a CPU profile without ``max_procs_per_node`` (the scheduler may bound it
#: further: Slurm by the partition's CPUs per node).
CPU_MAX_PROCS_PER_NODE = 256


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to render and submit one job; JSON-serialisable."""

    profile_name: str
    profile: ClusterProfile
    options: TrainingOptions
    nodes: int
    procs_per_node: int
    script: str
    script_args: list[str] = field(default_factory=list)
    job_name: str = "orchestrator"
    time_limit: str = "01:00:00"
    max_requeues: int = 3
    auto_resume: bool = False
    """After a node failure (a node stops answering), submit a new attempt without that node, from the
    last complete checkpoint. Bounded by ``max_requeues`` like the scheduler's own requeues."""
    exclude_nodes: tuple[str, ...] = ()
    """Nodes this job must not run on (``--exclude``): the ones earlier attempts lost."""
    after: tuple[str, ...] = ()
    """Scheduler dependencies (``--after JOB[:ok|any]``), e.g. ``("afterok:123",)``. Not carried by
    ``resume``: a new attempt of a run has no reason to wait again."""
    hang_timeout: int | None = None
    """Seconds without progress of any rank before the hang watchdog ends the step (None: derived
    from the step times the ranks report; see orchestrator.supervise.watchdog)."""
    max_restarts: int = 3
    """Restarts of the training step inside one allocation after a fault a restart cures (the
    profile's ``max_restarts``; :mod:`orchestrator.schedulers.slurm.batch_step`)."""
    budget: Budget | None = None
    """The run's spending cap over all its attempts (``--budget``, the profile's ``budget``; None: no
    cap): :mod:`orchestrator.config.budget`."""

    @property
    def strategy(self) -> Strategy:
        return STRATEGIES[self.options.strategy]

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def uses_cpu(self) -> bool:
        return self.profile.gpus_per_node == 0

    def to_json(self) -> dict[str, Any]:
        """The resolved submission, enough to re-submit by hand."""
        return {
            "profile_name": self.profile_name,
            "profile": self.profile.model_dump(mode="json"),
            "options": asdict(self.options),
            "nodes": self.nodes,
            "procs_per_node": self.procs_per_node,
            "world_size": self.world_size,
            "script": self.script,
            "script_args": list(self.script_args),
            "job_name": self.job_name,
            "time_limit": self.time_limit,
            "max_requeues": self.max_requeues,
            "auto_resume": self.auto_resume,
            "exclude_nodes": list(self.exclude_nodes),
            **({"after": list(self.after)} if self.after else {}),
            "hang_timeout": self.hang_timeout,
            "max_restarts": self.max_restarts,
            **({"budget": str(self.budget)} if self.budget is not None else {}),
        }

    @classmethod
    def from_json(cls, data: object) -> LaunchPlan:
        """The plan a run directory keeps (``job.json``), checked as a submission's plan is: a file
        edited to a bad value is a UserError naming the key (``resume`` printed a traceback)."""
        from orchestrator.config import inputs

        src = "job.json"
        if not isinstance(data, dict):
            raise UserError(f"{src}: expected a JSON object (the job's plan), got {type(data).__name__}")

        def need(key: str) -> Any:
            if key not in data:
                raise UserError(f"{src}: {key}: missing required key")
            return data[key]

        profile_name = inputs.optional_text(f"{src}: profile_name", need("profile_name"))
        raw_profile = need("profile")
        try:
            profile = ClusterProfile.model_validate(raw_profile, strict=False)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            from pydantic import ValidationError

            from orchestrator.config.profile.messages import format_validation_error

            if not isinstance(exc, ValidationError):
                raise
            first = format_validation_error(f"{src}: profile", exc).splitlines()[0]
            raise UserError(first) from None
        raw_options = need("options")
        if not isinstance(raw_options, dict):
            raise UserError(f"{src}: options: expected a mapping, got {type(raw_options).__name__}")
        try:
            options = options_from_json(raw_options)
        except TypeError as exc:
            raise UserError(f"{src}: options: {exc}") from None
        problem = check_option_values(options)
        if problem:
            raise UserError(f"{src}: options: {problem}")
        time_limit = inputs.optional_text(f"{src}: time_limit", need("time_limit"))
        assert time_limit is not None and profile_name is not None
        try:
            inputs.slurm_time_minutes(time_limit)
        except ValueError as exc:
            raise UserError(f"{src}: time_limit: expected {exc}") from None
        job_name = inputs.optional_text(f"{src}: job_name", need("job_name"))
        nodes = inputs.whole(f"{src}: nodes", need("nodes"), 1, optional=False)
        procs = inputs.whole(f"{src}: procs_per_node", need("procs_per_node"), 1, optional=False)
        requeues = inputs.whole(f"{src}: max_requeues", need("max_requeues"), 0, 100, optional=False)
        assert nodes is not None and procs is not None and requeues is not None
        return cls(
            profile_name=profile_name,
            profile=profile,
            options=options,
            nodes=nodes,
            procs_per_node=procs,
            script=str(inputs.path_text(f"{src}: script", need("script"))),
            script_args=inputs.words(f"{src}: script_args", need("script_args")),
            job_name=str(job_name),
            time_limit=time_limit,
            max_requeues=requeues,
            auto_resume=inputs.flag(f"{src}: auto_resume", data.get("auto_resume", False)),
            exclude_nodes=tuple(inputs.words(f"{src}: exclude_nodes", data.get("exclude_nodes", []))),
            after=tuple(inputs.words(f"{src}: after", data.get("after", []))),
            hang_timeout=inputs.whole(
                f"{src}: hang_timeout", data.get("hang_timeout"), 1, 86400, unit="seconds"
            ),
            # a plan written before the key: no restart (what that job was submitted with)
            max_restarts=inputs.whole(f"{src}: max_restarts", data.get("max_restarts", 0), 0, 100) or 0,
            budget=_budget_of(data.get("budget"), f"{src}: budget"),
        )


def _budget_of(value: object, where: str) -> Budget | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise UserError(f"{where}: expected a budget such as 200gpu-h (a string), got {type(value).__name__}")
    return parse_budget(value, where)


def merge_options(profile: ClusterProfile, **given: Any) -> TrainingOptions:
    """Command-line values (keyword per option, None: not given) win over the profile's ``defaults``."""
    return _merge(profile.defaults, given)


def check_combination(
    profile_name: str, profile: ClusterProfile, options: TrainingOptions, nodes: int, procs_per_node: int
) -> None:
    """Refuse what cannot work, saying why. Order: most basic problem first."""
    problem = check_option_values(options)
    if problem:
        raise UserError(problem)
    strategy = STRATEGIES[options.strategy]
    if nodes < 1:
        raise UserError(f"--nodes: expected an integer >= 1, got {nodes}")
    if nodes > profile.nodes.max:
        raise UserError(
            f"--nodes: {nodes} nodes requested but profile '{profile_name}' allows at most {profile.nodes.max} (nodes.max)"
        )
    if procs_per_node < 1:
        raise UserError(f"--procs-per-node: expected an integer >= 1, got {procs_per_node}")
    if profile.max_procs_per_node is not None and procs_per_node > profile.max_procs_per_node:
        raise UserError(
            f"--procs-per-node: {procs_per_node} processes per node but profile '{profile_name}' "
            f"allows at most {profile.max_procs_per_node} (max_procs_per_node)"
        )
    if profile.gpus_per_node and procs_per_node > profile.gpus_per_node:
        raise UserError(
            f"--procs-per-node: {procs_per_node} processes per node but profile '{profile_name}' "
            f"has {profile.gpus_per_node} GPUs per node (one process per GPU)"
        )
    if (
        not profile.gpus_per_node
        and profile.max_procs_per_node is None
        and procs_per_node > CPU_MAX_PROCS_PER_NODE
    ):
        raise UserError(
            f"--procs-per-node: {procs_per_node} processes per node on CPU profile '{profile_name}'; at most "
            f"{CPU_MAX_PROCS_PER_NODE} unless the profile sets max_procs_per_node"
        )
    if strategy.hybrid and nodes < 2:
        raise UserError(
            f"--strategy {strategy.name}: replicates across nodes and shards within one, so it needs >= 2 nodes "
            f"(got {nodes}); use full_shard or shard_grad_op on one node"
        )
    if strategy.hybrid and procs_per_node < 2:
        raise UserError(
            f"--strategy {strategy.name}: shards within a node, so it needs >= 2 processes per node "
            f"(got {procs_per_node}); use ddp"
        )
    if strategy.uses_fsdp and options.fsdp_version == 2 and strategy.fsdp2_reshard_after_forward is None:
        raise UserError(
            f"--strategy {strategy.name}: FSDP2 has no unsharded mode (Accelerate rejects dp_shard=1); "
            "use ddp, or --fsdp-version 1"
        )
    if options.mixed_precision == "fp16" and not profile.supports_fp16:
        raise UserError(
            f"--mixed-precision fp16: profile '{profile_name}' has no GPUs and fp16 autocast needs one; use bf16 or no"
        )
    if options.mixed_precision == "bf16" and not profile.supports_bf16:
        raise UserError(
            f"--mixed-precision bf16: profile '{profile_name}' has {profile.gpu_type} GPUs, which have no bf16 "
            "support (needs Ampere or newer); use fp16"
        )
    fsdp_only = fsdp_only_given(options)
    if fsdp_only and not strategy.uses_fsdp:
        raise UserError(
            f"{fsdp_only[0].flag}: only FSDP strategies support it, not {strategy.name}; drop {fsdp_only[0].flag} "
            f"(or pick an FSDP strategy such as full_shard)"
        )
    deepspeed_only = deepspeed_only_given(options)
    if deepspeed_only and not strategy.uses_deepspeed:
        raise UserError(
            f"{deepspeed_only[0].flag}: only DeepSpeed strategies support it, not {strategy.name}; drop "
            f"{deepspeed_only[0].flag} (or pick a DeepSpeed strategy such as deepspeed_zero3)"
        )
    _check_deepspeed(profile_name, profile, options, strategy)
    if strategy.uses_fsdp and options.offload and profile.gpus_per_node == 0:
        # Measured with torch 2.13: FSDP1 pins its CPU gradient buffers and FSDP2's CPUOffloadPolicy pins
        # the sharded parameters; both fail with "Cannot access accelerator device when none is available".
        raise UserError(
            f"--offload: moves parameters and optimizer state from GPU to host memory, but profile "
            f"'{profile_name}' has no GPUs (they already live in host memory, and FSDP's offload pins memory, "
            "which needs a GPU); drop --offload"
        )
    if (
        strategy.uses_fsdp
        and options.state_dict == "full"
        and options.fsdp_version == 1
        and profile.gpus_per_node == 0
    ):
        raise UserError(
            "--state-dict full: FSDP1 gathers full state dicts with offload_to_cpu, which crashes on CPU-only "
            "nodes; use --state-dict sharded or --fsdp-version 2"
        )


def _check_deepspeed(
    profile_name: str, profile: ClusterProfile, options: TrainingOptions, strategy: Strategy
) -> None:
    clip = options.gradient_clipping
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        raise UserError(f"--gradient-clipping: expected a finite number >= 0 (0: off), got {clip!r}")
    if not strategy.uses_deepspeed:
        return
    if strategy.deepspeed_stage != 3:
        for flag, on in (("--offload-params", options.offload_params), ("--zero3-save-16bit-model",
                         options.zero3_save_16bit_model)):  # fmt: skip
            if on:
                raise UserError(
                    f"{flag}: ZeRO-3 only (parameters are partitioned only at stage 3), not {strategy.name}; "
                    "use deepspeed_zero3"
                )
    if profile.gpus_per_node == 0 and (options.offload_optimizer or options.offload_params):
        flag = "--offload-optimizer" if options.offload_optimizer else "--offload-params"
        raise UserError(
            f"{flag}: moves state from GPU to host memory, but profile '{profile_name}' has no GPUs (it "
            f"already lives in host memory, and DeepSpeed's offload needs its compiled CPU Adam); drop {flag}"
        )


def build_plan(
    profile_name: str,
    profile: ClusterProfile,
    options: TrainingOptions,
    script: str,
    script_args: list[str] | None = None,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    job_name: str | None = None,
    time_limit: str | None = None,
    max_requeues: int | None = None,
    auto_resume: bool = False,
    exclude_nodes: tuple[str, ...] = (),
    after: tuple[str, ...] = (),
    hang_timeout: int | None = None,
    max_restarts: int | None = None,
    budget: Budget | None = None,
) -> LaunchPlan:
    """Check everything and return the plan; raises UserError with the reason."""
    node_count = profile.nodes.default if nodes is None else nodes
    procs = profile.default_procs_per_node if procs_per_node is None else procs_per_node
    check_combination(profile_name, profile, options, node_count, procs)
    kind = scheduler_kind(profile.scheduler)
    if auto_resume and not kind.can_lose_nodes:
        raise UserError(
            f"--auto-resume: profile '{profile_name}' runs locally, where there is no node to lose or exclude; "
            "use `orchestrator resume JOB` after a failure"
        )
    if exclude_nodes and not kind.can_lose_nodes:
        raise UserError(
            f"--exclude {','.join(exclude_nodes)}: profile '{profile_name}' runs locally, on this machine "
            "only: there is no node to exclude; drop --exclude"
        )
    if after and not kind.has_dependencies:
        raise UserError(
            f"--after: profile '{profile_name}' runs locally, where a job cannot wait for another; "
            "use a Slurm profile (or wait for the job first: orchestrator wait JOB)"
        )
    if profile.on_node_loss == "shrink" and not kind.can_lose_nodes:
        raise UserError(
            f"on_node_loss: shrink: profile '{profile_name}' runs locally, where there is no node to lose; "
            "drop on_node_loss (or use a Slurm profile)"
        )
    if profile.spare_nodes and not kind.can_lose_nodes:
        raise UserError(
            f"spare_nodes: profile '{profile_name}' runs locally, where there is no node to lose or replace; "
            "set spare_nodes: 0 (or use a Slurm profile)"
        )
    if hang_timeout is not None and not 1 <= hang_timeout <= 86400:
        raise UserError(f"--hang-timeout: expected seconds from 1 to 86400, got {hang_timeout}")
    if max_requeues is not None and not 0 <= max_requeues <= 100:
        raise UserError(f"--max-requeues: expected an integer from 0 to 100, got {max_requeues}")
    if max_restarts is not None and not 0 <= max_restarts <= 100:
        raise UserError(f"--max-restarts: expected an integer from 0 to 100, got {max_restarts}")
    if budget is None and profile.budget is not None:
        budget = parse_budget(profile.budget, f"profile '{profile_name}': budget")
    if budget is not None:
        check_budget(budget, profile_name, profile)
    if time_limit is not None:
        from orchestrator.config.inputs import slurm_time_minutes

        try:
            slurm_time_minutes(time_limit)
        except ValueError as exc:
            raise UserError(f"--time: expected {exc}") from None
    return LaunchPlan(
        profile_name=profile_name,
        profile=profile,
        options=options,
        nodes=node_count,
        procs_per_node=procs,
        script=script,
        script_args=list(script_args or []),
        job_name=job_name or f"{options.strategy}-{node_count}n",
        time_limit=time_limit or profile.time_limit,
        max_requeues=profile.max_requeues if max_requeues is None else max_requeues,
        auto_resume=auto_resume,
        exclude_nodes=tuple(sorted(set(exclude_nodes))),
        after=tuple(after),
        hang_timeout=profile.hang_timeout if hang_timeout is None else hang_timeout,
        max_restarts=profile.max_restarts if max_restarts is None else max_restarts,
        budget=budget,
    )
