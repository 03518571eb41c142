"""The training options, each declared once.

A strategy option is read from a profile's ``defaults:`` block, checked on a fast path and by a
pydantic schema, offered as a command-line flag, merged (command line over profile), checked
against the strategy, blamed on the profile key it came from, and carried over by ``resume``.
Each of those places derives from :class:`TrainingOptions` below, so a new option is one field
with its metadata, and no place can fall out of step with the others.

Field metadata (``option(...)``): ``choices`` (the allowed values; the first one's type is the
flag's type), ``fsdp_only`` / ``deepspeed_only`` (meaningless for other strategies: a profile's
value applies to those strategies only, a command-line value is refused for the others), ``help``
(the flag's help) and ``metavar`` (for free values). The type is the field's annotation: ``bool``
becomes a ``--x/--no-x`` flag, ``float`` a number.

Standard library only: this module is imported on every CLI start.
"""

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.config.strategies import STRATEGIES, STRATEGY_NAMES

_KEY = "orchestrator.option"


@dataclass(frozen=True)
class OptionSpec:
    """What a field's metadata says beyond its type and default."""

    choices: tuple[Any, ...] = ()
    """Allowed values, in the order error messages list them; empty: any value of the type."""
    fsdp_only: bool = False
    """Only FSDP strategies use it (others refuse it when given, ignore it from a profile)."""
    deepspeed_only: bool = False
    """Only DeepSpeed strategies use it (others refuse it when given, ignore it from a profile)."""

    @property
    def backend(self) -> str | None:
        """The strategy backend (``Strategy.backend``) it belongs to; None: every strategy."""
        return "fsdp" if self.fsdp_only else "deepspeed" if self.deepspeed_only else None

    help: str = ""
    """Command-line help."""
    metavar: str | None = None
    """Command-line placeholder for a free value."""


def option(
    default: Any,
    *,
    help: str,
    choices: tuple[Any, ...] = (),
    fsdp_only: bool = False,
    deepspeed_only: bool = False,
    metavar: str | None = None,
) -> Any:
    """A dataclass field carrying its :class:`OptionSpec` (typed ``Any`` as ``field()`` is)."""
    spec = OptionSpec(
        choices=choices, fsdp_only=fsdp_only, deepspeed_only=deepspeed_only, help=help, metavar=metavar
    )
    return dataclasses.field(default=default, metadata={_KEY: spec})


@dataclass(frozen=True)
class TrainingOptions:
    """Strategy options: a profile's ``defaults:``, and a plan's after merging the command line.

    Plain types (``str``, not a Literal of the choices): values come from argparse and JSON, and
    the choices are checked where the plan is built, with the reason in words.
    """

    strategy: str = option("ddp", choices=STRATEGY_NAMES, help="default: the profile's")
    """How training state is split across ranks; one of ``orchestrator.config.strategies.STRATEGIES``.
    ddp is the default because it needs nothing else (no wrap class, works on one node)."""
    fsdp_version: int = option(2, choices=(1, 2), help="default: 2")
    """FSDP implementation. 2 (per-parameter DTensor sharding) is where torch develops FSDP and its
    sharded checkpoints reshard freely; 1 stays one flag away for ``no_shard`` or flat parameters."""
    mixed_precision: str = option("no", choices=("no", "fp16", "bf16"), help="default: no")
    """Autocast precision. bf16 needs Ampere or newer GPUs (or CPU nodes), fp16 needs a GPU:
    both are refused on profiles that cannot run them, not left to fail at the first step."""
    offload: bool = option(False, fsdp_only=True, help="FSDP CPU offload")
    """Keep parameters and optimizer state in host memory: trades step time for GPU memory. FSDP's
    offload pins memory, so it needs GPUs even though the data lands on the CPU."""
    wrap_cls: str | None = option(
        None, fsdp_only=True, metavar="NAME", help="layer class wrapped as one FSDP unit"
    )
    """Layer class wrapped as one FSDP unit (TRANSFORMER_BASED_WRAP), e.g. ``TransformerBlock``.
    None: size-based wrapping, which needs no knowledge of the model."""
    state_dict: str = option("sharded", choices=("sharded", "full"), help="default: sharded")
    """Checkpoint format: sharded (DCP, one file per rank; loads at any world size) or full
    (gathered on rank 0, for tools that want one file)."""
    activation_checkpointing: bool = option(False, fsdp_only=True, help="recompute activations in backward")
    """Recompute activations in backward instead of keeping them: less memory, about a third more
    compute."""
    offload_optimizer: bool = option(
        False, deepspeed_only=True, help="DeepSpeed: optimizer state and step in host memory"
    )
    """ZeRO-Offload: optimizer state (and its step) in host memory. Needs GPUs: on CPU nodes the state
    already lives there."""
    offload_params: bool = option(
        False, deepspeed_only=True, help="DeepSpeed ZeRO-3: parameters in host memory"
    )
    """ZeRO-Infinity style parameter offload to host memory; ZeRO-3 only, and GPUs only."""
    gradient_clipping: float = option(
        1.0, deepspeed_only=True, metavar="NORM", help="DeepSpeed: max gradient norm (0: off); default 1.0"
    )
    """The gradient norm DeepSpeed clips to (DeepSpeed clips, not the script). 0 turns clipping off,
    which Accelerate's yaml cannot say (it drops 0.0 and DeepSpeed clips at 1.0): the node then gets
    a ``deepspeed_config_file`` JSON instead."""
    zero3_save_16bit_model: bool = option(
        False, deepspeed_only=True, help="DeepSpeed ZeRO-3: gather a 16-bit model on save"
    )
    """ZeRO-3: ``save_model`` gathers the full 16-bit weights into one file on rank 0 (for inference
    tools); checkpoints themselves stay per-rank shards."""
    script_hooks: bool = option(
        True, help="the ranks' import hook: self-check, CPU workarounds, Trainer resume and stop"
    )
    """The node's import hook in every rank (``orchestrator.rank.script_hooks``): ``Accelerator()`` gets
    the CPU workarounds and the self-check, an unchanged ``Trainer`` the resume from the newest complete
    checkpoint, the agreed stop and progress. Off: the script runs exactly as written."""


@dataclass(frozen=True)
class Option:
    """One declared option, resolved: what each derivation reads."""

    name: str
    type: Any
    """The annotation as an object (``str``, ``int``, ``bool``, ``str | None``)."""
    default: Any
    spec: OptionSpec

    @property
    def flag(self) -> str:
        """The command-line flag, also the prefix of every message about the option."""
        return "--" + self.name.replace("_", "-")

    @property
    def profile_key(self) -> str:
        """Where a profile sets it."""
        return f"defaults.{self.name}"

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    def expected(self) -> str:
        """The allowed values in words: ``1 or 2``, ``no, fp16 or bf16``."""
        words = [str(c) for c in self.spec.choices]
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _declared() -> tuple[Option, ...]:
    hints = typing.get_type_hints(TrainingOptions)  # annotations as objects, even if written as strings
    found = []
    for f in dataclasses.fields(TrainingOptions):
        spec = f.metadata.get(_KEY)
        if not isinstance(spec, OptionSpec):
            raise TypeError(f"TrainingOptions.{f.name}: declare it with option(...)")
        found.append(Option(f.name, hints[f.name], f.default, spec))
    return tuple(found)


#: Every option, in declaration order (the order of ``LaunchPlan.to_json()["options"]``).
OPTIONS: tuple[Option, ...] = _declared()
OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option, every default None: "not given" must stay distinct from a value, so the
    profile's default applies only where the user typed nothing."""
    for o in OPTIONS:
        kwargs: dict[str, Any] = {"default": None, "help": o.spec.help or None}
        if o.is_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        if o.spec.choices:
            kwargs["choices"] = list(o.spec.choices)
            if not isinstance(o.spec.choices[0], str):
                kwargs["type"] = type(o.spec.choices[0])
        elif o.type in (int, float):
            kwargs["type"] = o.type
        if o.spec.metavar:
            kwargs["metavar"] = o.spec.metavar
        parser.add_argument(o.flag, dest=o.name, **kwargs)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The option values of parsed arguments (None: not given)."""
    return {o.name: getattr(args, o.name, None) for o in OPTIONS}


def merge_options(defaults: TrainingOptions, given: Mapping[str, Any]) -> TrainingOptions:
    """Given values (None: not given) win over ``defaults`` (a profile's).

    A profile's FSDP-only (DeepSpeed-only) values apply to FSDP (DeepSpeed) strategies only:
    ``--strategy ddp`` on a profile with ``defaults.wrap_cls`` must not be refused for a flag nobody
    typed. Given values are kept whatever the strategy, so the plan check refuses them.
    """
    unknown = set(given) - set(OPTIONS_BY_NAME)
    if unknown:
        raise TypeError(f"merge_options: unknown option(s) {', '.join(sorted(unknown))}")
    strategy = given.get("strategy")
    chosen = defaults.strategy if strategy is None else strategy
    backend = STRATEGIES[chosen].backend if chosen in STRATEGIES else None
    values: dict[str, Any] = {}
    for o in OPTIONS:
        value = given.get(o.name)
        if value is None:
            applies = o.spec.backend is None or o.spec.backend == backend
            value = getattr(defaults, o.name) if applies else o.default
        values[o.name] = value
    return TrainingOptions(**values)


def check_option_values(options: TrainingOptions) -> str | None:
    """The first value outside its choices, as a one-line refusal; None when all are allowed.

    The strategy gets a did-you-mean: it is the one option people type from memory.
    """
    for o in OPTIONS:
        value = getattr(options, o.name)
        if not o.spec.choices or value in o.spec.choices:
            continue
        if o.name == "strategy":
            import difflib

            guess = difflib.get_close_matches(str(value), [str(c) for c in o.spec.choices], n=1)
            hint = f" (did you mean '{guess[0]}'?)" if guess else ""
            known = ", ".join(str(c) for c in o.spec.choices)
            return f"{o.flag}: unknown strategy '{value}'{hint}; known: {known}"
        return f"{o.flag}: expected {o.expected()}, got {value!r}"
    return None


def fsdp_only_given(options: TrainingOptions) -> list[Option]:
    """The FSDP-only options that are set (truthy), in declaration order."""
    return [o for o in OPTIONS if o.spec.fsdp_only and getattr(options, o.name)]


def deepspeed_only_given(options: TrainingOptions) -> list[Option]:
    """The DeepSpeed-only options that differ from their defaults, in declaration order."""
    return [o for o in OPTIONS if o.spec.deepspeed_only and getattr(options, o.name) != o.default]


def options_from_json(data: Mapping[str, Any]) -> TrainingOptions:
    """A plan's ``options`` as written by ``dataclasses.asdict``; keys unknown here are ignored and
    missing ones take the default, so run directories of other versions still load."""
    return TrainingOptions(**{k: v for k, v in data.items() if k in OPTIONS_BY_NAME})
