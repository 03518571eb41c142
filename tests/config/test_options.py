"""orchestrator.config.options: one declaration per training option, and every place that derives from it.

The CLI flags, the profile's ``defaults:`` record, its fast checks and its pydantic model, the merge
of command line over profile, the plan checks, the blame map and resume's carry-over all read
``dataclasses.fields(TrainingOptions)``. These tests hold them to it: same names, same defaults,
and each field, whatever it is, reaches each of them.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli.plan_args import add_plan_arguments, plan_from_args
from orchestrator.cli.resume import resume_plan
from orchestrator.config import options as O
from orchestrator.config.options import OPTIONS, TrainingOptions
from orchestrator.config.plan import LaunchPlan, build_plan, check_combination, merge_options
from orchestrator.config.profile import schema as S
from orchestrator.config.profile.load import load_profile, parse_profile
from orchestrator.config.profile.records import ClusterProfile, TrainingDefaults
from orchestrator.config.strategies import STRATEGIES, STRATEGY_NAMES
from orchestrator.contract.errors import UserError
from orchestrator.runner.planning import _PROFILE_KEYS

NAMES = [f.name for f in dataclasses.fields(TrainingOptions)]
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingOptions)}
GPU_PROFILE = (
    "scheduler: slurm\npartition: gpu\ngpus_per_node: 8\ngpu_type: a100\nnodes: {default: 2, max: 8}\n"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser


def _sample(o: O.Option) -> Any:
    """A valid value other than the default."""
    if o.spec.choices:
        return next(c for c in o.spec.choices if c != o.default)
    if o.is_bool:
        return not o.default
    if o.type is float:
        return 0.5
    return "TransformerBlock"


def _cli_words(o: O.Option, value: Any) -> list[str]:
    if o.is_bool:
        return [o.flag if value else "--no-" + o.flag[2:]]
    return [o.flag, str(value)]


# ------------------------------------------------------------------- one declaration, every layer


def test_one_declaration_drives_cli_schema_fast_checks_and_profile_record() -> None:
    """Equal sets of names and equal defaults in every layer."""
    option_dests = {a.dest: a for a in _parser()._actions if a.dest in NAMES}
    only_options = argparse.ArgumentParser(add_help=False)
    O.add_option_arguments(only_options)
    assert [a.dest for a in only_options._actions] == NAMES
    model = S.schema()["TrainingDefaults"]

    assert set(option_dests) == set(NAMES)
    assert list(model.model_fields) == NAMES
    assert list(S._FAST_CHECKS[TrainingDefaults]) == NAMES
    assert list(TrainingDefaults.model_fields) == NAMES
    assert {flag: entry for flag, entry in _PROFILE_KEYS.items() if entry[0] in NAMES} == {
        "--" + n.replace("_", "-"): (n, f"defaults.{n}") for n in NAMES
    }

    assert {n: a.default for n, a in option_dests.items()} == dict.fromkeys(NAMES)  # None: "not given"
    assert {n: info.default for n, info in model.model_fields.items()} == DEFAULTS
    assert TrainingDefaults.model_fields == DEFAULTS
    assert dataclasses.asdict(parse_profile("scheduler: local\n", "p.yaml").defaults) == DEFAULTS
    assert dataclasses.asdict(TrainingOptions()) == DEFAULTS


@pytest.mark.parametrize("o", OPTIONS, ids=lambda o: o.name)
def test_cli_flag_follows_the_declaration(o: O.Option) -> None:
    action = next(a for a in _parser()._actions if a.dest == o.name)
    assert o.flag in action.option_strings
    assert action.help == o.spec.help
    if o.is_bool:
        assert isinstance(action, argparse.BooleanOptionalAction)
    if o.spec.choices:
        assert list(action.choices or ()) == list(o.spec.choices)
        parsed = _parser().parse_args([o.flag, str(o.spec.choices[-1])])
        assert getattr(parsed, o.name) == o.spec.choices[-1]  # typed as the choices are (1, not "1")
    if o.type is float:
        assert getattr(_parser().parse_args([o.flag, "0"]), o.name) == 0.0  # a number, not "0"
    if o.spec.metavar:
        assert action.metavar == o.spec.metavar


def test_every_field_is_declared_with_option() -> None:
    assert [o.name for o in OPTIONS] == NAMES
    for f in dataclasses.fields(TrainingOptions):
        assert isinstance(f.metadata.get("orchestrator.option"), O.OptionSpec), f.name
    assert list(O.OPTIONS_BY_NAME) == NAMES


def test_strategy_choices_are_the_strategy_table() -> None:
    assert O.OPTIONS_BY_NAME["strategy"].spec.choices == STRATEGY_NAMES == tuple(STRATEGIES)


# ------------------------------------------------------------------- each field reaches each place


@pytest.mark.parametrize("o", OPTIONS, ids=lambda o: o.name)
def test_field_reaches_every_place(o: O.Option, tmp_path: Path) -> None:
    value = _sample(o)
    # A strategy every option of its group applies to.
    strategy = "deepspeed_zero3" if o.spec.deepspeed_only else "full_shard"
    # The profile's defaults: (fast path, no pydantic needed) ...
    profile_text = GPU_PROFILE + yaml.safe_dump({"defaults": {"strategy": strategy, o.name: value}})
    profile = parse_profile(profile_text, "p.yaml")
    assert getattr(profile.defaults, o.name) == value
    assert S.fast_validate(ClusterProfile, profile.model_dump()) == profile
    # ... the merge (profile value when not given, the given one otherwise) ...
    assert getattr(merge_options(profile), o.name) == value
    assert getattr(merge_options(ClusterProfile(scheduler="local"), **{o.name: value}), o.name) == value
    # ... the command line ...
    (tmp_path / "gpu.yaml").write_text(GPU_PROFILE)
    args = _parser().parse_args(
        ["--profile", str(tmp_path / "gpu.yaml"), *(["--strategy", strategy] if o.name != "strategy" else []),
         *_cli_words(o, value), "--", "train.py"]
    )  # fmt: skip
    plan = plan_from_args(args)
    assert getattr(plan.options, o.name) == value
    # ... the plan's JSON (run directories) ...
    again = LaunchPlan.from_json(plan.to_json())
    assert again.options == plan.options
    # ... and resume's carry-over.
    resumed = resume_plan(plan, argparse.Namespace(profile=None, profiles_dir=None, strategy=None, nodes=None,
                                                   procs_per_node=None, budget=None))  # fmt: skip
    assert getattr(resumed.options, o.name) == value


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.spec.choices], ids=lambda o: o.name)
def test_bad_value_is_refused_in_every_layer(o: O.Option) -> None:
    bad = "nonsense"
    # In a profile: one line naming the file and the key, worded by pydantic.
    with pytest.raises(UserError) as info:
        parse_profile(f"scheduler: local\ndefaults: {{{o.name}: {bad}}}\n", "p.yaml")
    message = str(info.value)
    assert message.startswith(f"p.yaml: defaults.{o.name}: expected ") and "\n" not in message
    # In a plan (a hand-written job.json, say): the flag, and what is allowed.
    options = dataclasses.replace(TrainingOptions(), **{o.name: bad})
    with pytest.raises(UserError) as info:
        check_combination("p", ClusterProfile(scheduler="local"), options, 1, 1)
    assert str(info.value).startswith(f"{o.flag}: ")
    # On the command line: argparse's own refusal.
    with pytest.raises(SystemExit):
        _parser().parse_args([o.flag, bad])


def test_bad_profile_value_is_blamed_on_its_key(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "scheduler: local\ngpus_per_node: 0\ndefaults: {mixed_precision: fp16}\n"
    )
    args = _parser().parse_args(["--profile", str(tmp_path / "p.yaml"), "--", "train.py"])
    with pytest.raises(
        UserError, match=r"\(--mixed-precision not given; set by .*p\.yaml: defaults\.mixed_precision\)"
    ):
        plan_from_args(args)


# ------------------------------------------------------------------- FSDP-only options


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.spec.fsdp_only], ids=lambda o: o.name)
def test_fsdp_only_profile_value_applies_to_fsdp_strategies_only(o: O.Option) -> None:
    value = _sample(o)
    profile = parse_profile(GPU_PROFILE + yaml.safe_dump({"defaults": {o.name: value}}), "p.yaml")
    assert getattr(merge_options(profile, strategy="full_shard"), o.name) == value
    ddp = merge_options(profile, strategy="ddp")
    assert getattr(ddp, o.name) == o.default
    check_combination("p", profile, ddp, 2, 8)  # a value nobody typed is not refused
    typed = merge_options(profile, strategy="ddp", **{o.name: value})
    with pytest.raises(UserError, match=f"^{o.flag}: only FSDP strategies support it"):
        check_combination("p", profile, typed, 2, 8)


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.spec.deepspeed_only], ids=lambda o: o.name)
def test_deepspeed_only_profile_value_applies_to_deepspeed_strategies_only(o: O.Option) -> None:
    value = _sample(o)
    profile = parse_profile(GPU_PROFILE + yaml.safe_dump({"defaults": {o.name: value}}), "p.yaml")
    assert getattr(merge_options(profile, strategy="deepspeed_zero3"), o.name) == value
    for other in ("ddp", "full_shard"):
        merged = merge_options(profile, strategy=other)
        assert getattr(merged, o.name) == o.default
        check_combination("p", profile, merged, 2, 8)  # a value nobody typed is not refused
        typed = merge_options(profile, strategy=other, **{o.name: value})
        with pytest.raises(UserError, match=f"^{o.flag}: only DeepSpeed strategies support it, not {other}"):
            check_combination("p", profile, typed, 2, 8)


@pytest.mark.parametrize(
    ("strategy", "given", "refusal"),
    [
        ("deepspeed_zero2", {"offload_params": True}, "^--offload-params: ZeRO-3 only"),
        ("deepspeed_zero1", {"zero3_save_16bit_model": True}, "^--zero3-save-16bit-model: ZeRO-3 only"),
        (
            "deepspeed_zero3",
            {"gradient_clipping": -1.0},
            "^--gradient-clipping: expected a finite number >= 0",
        ),
        ("deepspeed_zero3", {"gradient_clipping": float("nan")}, "^--gradient-clipping: expected a finite"),
        (
            "deepspeed_zero3",
            {"wrap_cls": "Block"},
            "^--wrap-cls: only FSDP strategies support it, not deepspeed_zero3",
        ),
    ],
)
def test_deepspeed_combinations_refused_with_a_reason(strategy: str, given: dict, refusal: str) -> None:
    profile = parse_profile(GPU_PROFILE, "p.yaml")
    with pytest.raises(UserError, match=refusal):
        check_combination("p", profile, merge_options(profile, strategy=strategy, **given), 2, 8)


def test_deepspeed_offload_refused_on_cpu_profiles() -> None:
    _, _, cpu = load_profile("local")
    for flag, name in (("--offload-optimizer", "offload_optimizer"), ("--offload-params", "offload_params")):
        options = merge_options(cpu, strategy="deepspeed_zero3", **{name: True})
        with pytest.raises(UserError, match=f"^{flag}: .* has no GPUs"):
            check_combination("local", cpu, options, 1, 2)
    check_combination(
        "local", cpu, merge_options(cpu, strategy="deepspeed_zero3", gradient_clipping=0.0), 2, 2
    )


def test_non_fsdp_options_apply_to_ddp_too() -> None:
    profile = parse_profile(GPU_PROFILE + "defaults: {mixed_precision: bf16, state_dict: full}\n", "p.yaml")
    ddp = merge_options(profile, strategy="ddp")
    assert (ddp.mixed_precision, ddp.state_dict) == ("bf16", "full")


def test_merge_refuses_an_unknown_option() -> None:
    with pytest.raises(TypeError, match="wrapcls"):
        merge_options(ClusterProfile(scheduler="local"), wrapcls="Block")


# ------------------------------------------------------------------- compatibility


def test_options_json_is_unchanged() -> None:
    """Run directories written before the declaration moved still load, and new ones look the same."""
    written_before = {
        "strategy": "full_shard", "fsdp_version": 2, "mixed_precision": "bf16", "offload": False,
        "wrap_cls": "TransformerBlock", "state_dict": "sharded", "activation_checkpointing": True,
    }  # fmt: skip
    options = O.options_from_json(written_before)
    # Options added since (DeepSpeed's, the script hooks' switch) take their defaults and come after the old ones.
    added = {k: v for k, v in DEFAULTS.items() if k not in written_before}
    assert set(added) == {
        "offload_optimizer",
        "offload_params",
        "gradient_clipping",
        "zero3_save_16bit_model",
        "script_hooks",
    }
    assert dataclasses.asdict(options) == {**written_before, **added}
    assert list(dataclasses.asdict(options)) == [*written_before, *added]
    _, _, profile = load_profile("slurm_a100")
    plan = build_plan("slurm_a100", profile, options, script="train.py", nodes=2)
    assert plan.to_json()["options"] == {**written_before, **added}
    assert LaunchPlan.from_json(plan.to_json()) == plan


def test_plan_reexports_training_options() -> None:
    from orchestrator.config import plan

    assert plan.TrainingOptions is TrainingOptions
    assert isinstance(parse_profile("scheduler: local\n", "p.yaml").defaults, TrainingOptions)


def test_selfcheck_uses_the_strategy_table() -> None:
    from orchestrator.rank import selfcheck

    assert tuple(selfcheck.STRATEGIES) == STRATEGY_NAMES
    assert set(selfcheck.HYBRID) == {n for n, s in STRATEGIES.items() if s.hybrid}
    assert {n: s.fsdp1_sharding for n, s in STRATEGIES.items() if s.uses_fsdp} == selfcheck.FSDP1_SHARDING
    assert {
        n: s.fsdp2_reshard_after_forward
        for n, s in STRATEGIES.items()
        if s.fsdp2_reshard_after_forward is not None
    } == selfcheck.FSDP2_RESHARD
