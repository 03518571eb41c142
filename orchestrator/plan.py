"""Planning: profile + options + command in, a checked ``LaunchPlan`` out.

Pure functions only. Every impossible combination is refused here, before any
rendering or submission, with the reason in one line; the dry run, ``render``
and ``submit`` all share this one path (torchx's split of plan and execution).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from orchestrator.errors import UserError
from orchestrator.profiles import ClusterProfile
from orchestrator.strategies import STRATEGIES, Strategy


@dataclass(frozen=True)
class TrainingOptions:
    """Strategy options after merging the profile's defaults and the command line."""

    strategy: str
    """One of ``orchestrator.strategies.STRATEGIES``."""
    fsdp_version: int = 2
    """1 or 2; see README for why 2 is the default."""
    mixed_precision: str = "no"
    """no | fp16 | bf16."""
    offload: bool = False
    """CPU offload of parameters and optimizer state (FSDP only)."""
    wrap_cls: str | None = None
    """Layer class to wrap as one FSDP unit; None means size-based wrapping."""
    state_dict: str = "sharded"
    """sharded (DCP, one file per rank) or full (gathered on rank 0)."""
    activation_checkpointing: bool = False
    """FSDP activation checkpointing."""


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
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchPlan:
        return cls(
            profile_name=data["profile_name"],
            profile=ClusterProfile.model_validate(data["profile"], strict=False),
            options=TrainingOptions(**data["options"]),
            nodes=int(data["nodes"]),
            procs_per_node=int(data["procs_per_node"]),
            script=data["script"],
            script_args=list(data["script_args"]),
            job_name=data["job_name"],
            time_limit=data["time_limit"],
            max_requeues=int(data["max_requeues"]),
            auto_resume=bool(data.get("auto_resume", False)),
            exclude_nodes=tuple(data.get("exclude_nodes", ())),
        )


def merge_options(
    profile: ClusterProfile,
    strategy: str | None = None,
    fsdp_version: int | None = None,
    mixed_precision: str | None = None,
    offload: bool | None = None,
    wrap_cls: str | None = None,
    state_dict: str | None = None,
    activation_checkpointing: bool | None = None,
) -> TrainingOptions:
    """Command-line values win over the profile's ``defaults`` block."""
    d = profile.defaults

    def pick(cli: Any, default: Any) -> Any:
        return default if cli is None else cli

    chosen = pick(strategy, d.strategy)
    # The profile's FSDP-only defaults (wrap_cls, offload, ...) apply to FSDP strategies only:
    # `--strategy ddp` on a profile with `defaults.wrap_cls` must not be refused for a flag
    # nobody typed. Given on the command line, they are still checked (and refused for ddp).
    fsdp = chosen in STRATEGIES and STRATEGIES[chosen].uses_fsdp

    def pick_fsdp(cli: Any, default: Any, off: Any) -> Any:
        return cli if cli is not None else default if fsdp else off

    return TrainingOptions(
        strategy=chosen,
        fsdp_version=pick(fsdp_version, d.fsdp_version),
        mixed_precision=pick(mixed_precision, d.mixed_precision),
        offload=pick_fsdp(offload, d.offload, False),
        wrap_cls=pick_fsdp(wrap_cls, d.wrap_cls, None),
        state_dict=pick(state_dict, d.state_dict),
        activation_checkpointing=pick_fsdp(activation_checkpointing, d.activation_checkpointing, False),
    )


def check_combination(
    profile_name: str, profile: ClusterProfile, options: TrainingOptions, nodes: int, procs_per_node: int
) -> None:
    """Refuse what cannot work, saying why. Order: most basic problem first."""
    if options.strategy not in STRATEGIES:
        import difflib

        guess = difflib.get_close_matches(options.strategy, list(STRATEGIES), n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        raise UserError(f"--strategy: unknown strategy '{options.strategy}'{hint}; known: {', '.join(STRATEGIES)}")
    strategy = STRATEGIES[options.strategy]
    if options.fsdp_version not in (1, 2):
        raise UserError(f"--fsdp-version: expected 1 or 2, got {options.fsdp_version!r}")
    if options.mixed_precision not in ("no", "fp16", "bf16"):
        raise UserError(f"--mixed-precision: expected no, fp16 or bf16, got {options.mixed_precision!r}")
    if options.state_dict not in ("sharded", "full"):
        raise UserError(f"--state-dict: expected sharded or full, got {options.state_dict!r}")
    if nodes < 1:
        raise UserError(f"--nodes: expected an integer >= 1, got {nodes}")
    if nodes > profile.nodes.max:
        raise UserError(
            f"--nodes: {nodes} nodes requested but profile '{profile_name}' allows at most {profile.nodes.max} (nodes.max)"
        )
    if procs_per_node < 1:
        raise UserError(f"--procs-per-node: expected an integer >= 1, got {procs_per_node}")
    if profile.gpus_per_node and procs_per_node > profile.gpus_per_node:
        raise UserError(
            f"--procs-per-node: {procs_per_node} processes per node but profile '{profile_name}' "
            f"has {profile.gpus_per_node} GPUs per node (one process per GPU)"
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
    if not strategy.uses_fsdp:
        for flag, value in (
            ("--offload", options.offload),
            ("--activation-checkpointing", options.activation_checkpointing),
            ("--wrap-cls", options.wrap_cls),
        ):
            if value:
                raise UserError(f"{flag}: only FSDP strategies support it, not ddp; pick full_shard or shard_grad_op")
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
) -> LaunchPlan:
    """Check everything and return the plan; raises UserError with the reason."""
    node_count = profile.nodes.default if nodes is None else nodes
    procs = profile.default_procs_per_node if procs_per_node is None else procs_per_node
    check_combination(profile_name, profile, options, node_count, procs)
    if auto_resume and profile.scheduler != "slurm":
        raise UserError(
            f"--auto-resume: profile '{profile_name}' runs locally, where there is no node to lose or exclude; "
            "use `orchestrator resume JOB` after a failure"
        )
    if max_requeues is not None and max_requeues < 0:
        raise UserError(f"--max-requeues: expected an integer >= 0, got {max_requeues}")
    if time_limit is not None:
        from orchestrator.profiles import _TIME_RE

        if not _TIME_RE.match(time_limit):
            raise UserError(f"--time: expected a Slurm time such as '04:00:00' or '90' (minutes), got {time_limit!r}")
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
    )


Scheduler = Literal["slurm", "local"]
