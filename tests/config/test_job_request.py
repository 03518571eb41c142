"""orchestrator.config.job_request: a job's request declared once, and every place that derives from it.

Four places read ``JobRequest``'s fields: the API's keywords (``make_plan``, ``submit``, ``sweep``:
``PlanKeywords`` for the type checker), the CLI's plan flags (``submit``, ``sweep``, ``render``), the
planning path (``JobRequest.checked``, ``plan_inputs`` -> ``build_plan``) and the command line a
laptop sends its login host (``remote.handles.plan_flags``). :func:`_samples` says, for each keyword,
a value other than its default, the words a command line asks for it with, and where the plan
shows it. Each place is walked with every sample, so a keyword removed from the declaration fails
in each place (the API and the login host refuse it as an unknown keyword, the CLI as an unknown
flag, the planning path cannot take it), and one added without a sample fails
:func:`test_every_keyword_has_a_sample`. ``tests/remote/test_remote_request.py`` carries the same
request through a real SSH connection.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import orchestrator
from orchestrator.cli.main import build_parser
from orchestrator.cli.plan_args import plan_from_args, request_from_args
from orchestrator.config import job_request as R
from orchestrator.config.job_request import KEYWORDS, JobRequest, PlanKeywords
from orchestrator.config.options import OPTIONS_BY_NAME
from orchestrator.config.plan import LaunchPlan, build_plan
from orchestrator.contract.errors import UserError
from orchestrator.remote.handles import plan_flags
from orchestrator.runner.planning import plan_request

#: A Slurm profile (every keyword applies to it: --after, --exclude, --auto-resume) with a container.
PROFILE = """description: {description}
scheduler: slurm
partition: debug
time_limit: "01:00:00"
nodes: {{default: 1, max: 4}}
gpus_per_node: 0
procs_per_node: 1
max_requeues: 3
container: {{runtime: apptainer, image: /images/base.sif}}
"""


@dataclass(frozen=True)
class Sample:
    value: Any
    """The API's value (a keyword of ``make_plan``)."""
    words: tuple[str, ...]
    """The command line's words for it (before ``--``; for ``script``/``args``: after it)."""
    shows: Callable[[LaunchPlan], Any]
    """Where the plan shows it."""
    expected: Any


def _samples(folders: Folders) -> dict[str, Sample]:
    other = str(folders.other_profile)
    return {
        "script": Sample("other.py", ("other.py",), lambda p: p.script, "other.py"),
        "args": Sample(["--lr", "0.1", "a b"], ("--lr", "0.1", "a b"), lambda p: p.script_args, ["--lr", "0.1", "a b"]),
        "profile": Sample(other, ("--profile", other), lambda p: p.profile.description, "the other profile"),
        "profiles_dir": Sample(
            str(folders.second), ("--profiles-dir", str(folders.second)), lambda p: p.profile.description,
            "probe from the second folder",
        ),
        "nodes": Sample(3, ("--nodes", "3"), lambda p: p.nodes, 3),
        "procs_per_node": Sample(2, ("--procs-per-node", "2"), lambda p: p.procs_per_node, 2),
        "strategy": Sample("full_shard", ("--strategy", "full_shard"), lambda p: p.options.strategy, "full_shard"),
        "options": Sample(
            {"mixed_precision": "bf16", "script_hooks": False}, ("--mixed-precision", "bf16", "--no-script-hooks"),
            lambda p: (p.options.mixed_precision, p.options.script_hooks), ("bf16", False),
        ),
        "name": Sample("probe job", ("--name", "probe job"), lambda p: p.job_name, "probe job"),
        "time": Sample("00:30:00", ("--time", "00:30:00"), lambda p: p.time_limit, "00:30:00"),
        "max_requeues": Sample(1, ("--max-requeues", "1"), lambda p: p.max_requeues, 1),
        "max_restarts": Sample(1, ("--max-restarts", "1"), lambda p: p.max_restarts, 1),
        "auto_resume": Sample(True, ("--auto-resume",), lambda p: p.auto_resume, True),
        "hang_timeout": Sample(900, ("--hang-timeout", "900"), lambda p: p.hang_timeout, 900),
        "container_image": Sample(
            "/images/other.sif", ("--container-image", "/images/other.sif"), lambda p: p.profile.container.image,
            "/images/other.sif",
        ),
        "exclude": Sample("n1,n2", ("--exclude", "n1,n2"), lambda p: p.exclude_nodes, ("n1", "n2")),
        "after": Sample(
            ["123", "456:any"], ("--after", "123", "--after", "456:any"), lambda p: p.after,
            ("afterok:123", "afterany:456"),
        ),
        "budget": Sample("0.5cpu-h", ("--budget", "0.5cpu-h"), lambda p: str(p.budget), "0.5cpu-h"),
    }  # fmt: skip


@dataclass(frozen=True)
class Folders:
    first: Path
    """``probe.yaml``: the base request's profile."""
    second: Path
    """Another ``probe.yaml``: found only through ``profiles_dir``."""
    other_profile: Path

    @property
    def base(self) -> dict[str, Any]:
        """The keywords every sample is added to."""
        return {"script": "job.py", "profile": "probe", "profiles_dir": str(self.first)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    root = tmp_path_factory.mktemp("request")
    for folder, description in (("first", "probe"), ("second", "probe from the second folder")):
        (root / folder).mkdir()
        (root / folder / "probe.yaml").write_text(PROFILE.format(description=description))
    (root / "other.yaml").write_text(PROFILE.format(description="the other profile"))
    return Folders(root / "first", root / "second", root / "other.yaml")


@pytest.fixture(scope="module")
def samples(folders: Folders) -> dict[str, Sample]:
    return _samples(folders)


NAMES = [k.name for k in KEYWORDS]
#: The keywords :func:`_samples` has, written out: the tests walk these, not the declaration's, so a
#: keyword dropped from the declaration is still asked for, and each place it was lost from fails.
SAMPLED = ("script", "args", "profile", "profiles_dir", "nodes", "procs_per_node", "strategy", "options",
           "name", "time", "max_requeues", "max_restarts", "auto_resume", "hang_timeout", "container_image", "exclude", "after",
           "budget")  # fmt: skip


def _argv(folders: Folders, sample: Sample | None, name: str, *, send_folder: bool = True) -> list[str]:
    """``submit``'s words for the base request with ``sample`` of keyword ``name`` added."""
    base = ["--profile", "probe", *(["--profiles-dir", str(folders.first)] if send_folder else [])]
    flags = [*base, *(sample.words if sample and name not in ("script", "args") else ())]
    script = list(sample.words) if sample and name == "script" else ["job.py"]
    args = list(sample.words) if sample and name == "args" else []
    return ["submit", *flags, "--", *script, *args]


@pytest.fixture
def no_profile_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("ORCHESTRATOR_PROFILE", "ORCHESTRATOR_PROFILES"):
        monkeypatch.delenv(name, raising=False)
    yield


# ------------------------------------------------------------------- the declaration itself


def test_every_keyword_has_a_sample(
    samples: dict[str, Sample], folders: Folders, no_profile_env: None
) -> None:
    """A sample per keyword, in declaration order, each one changing what the plan shows."""
    assert list(samples) == list(SAMPLED) == NAMES
    plain = orchestrator.make_plan(**folders.base)
    for name, sample in samples.items():
        assert sample.shows(plain) != sample.expected, f"{name}: the sample changes nothing in the plan"


def test_every_field_is_declared_with_keyword() -> None:
    for f in dataclasses.fields(JobRequest):
        assert isinstance(f.metadata.get("orchestrator.keyword"), R.KeywordSpec), f.name
        assert f.kw_only, f.name
    assert list(R.KEYWORDS_BY_NAME) == NAMES
    assert {k.spec.form for k in KEYWORDS} <= set(R.FORMS)
    assert [k.name for k in KEYWORDS if k.required] == ["script"]
    # the options' flags stand once in a command line: each "option" keyword is one of them
    assert {k.name for k in KEYWORDS if k.spec.form == "option"} <= set(OPTIONS_BY_NAME)


# ------------------------------------------------------------------- the API


def test_the_type_checkers_keywords_are_the_declaration() -> None:
    """``PlanKeywords`` (what mypy checks ``submit``/``sweep``/``make_plan`` calls against) has each
    field with its type; the signatures ``help()`` shows list the same keywords."""
    assert typing.get_type_hints(PlanKeywords) == typing.get_type_hints(JobRequest)
    assert PlanKeywords.__required_keys__ == {k.name for k in KEYWORDS if k.required}
    for func in (
        orchestrator.make_plan,
        orchestrator.submit,
        orchestrator.sweep,
        orchestrator.api.sweep_plan_points,
    ):
        shown = [p.name for p in inspect.signature(func).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert shown[-len(NAMES) :] == NAMES, func.__name__


@pytest.mark.parametrize("name", SAMPLED)
def test_the_api_carries_each_keyword(
    name: str, samples: dict[str, Sample], folders: Folders, no_profile_env: None
) -> None:
    sample = samples[name]
    plan = orchestrator.make_plan(**{**folders.base, name: sample.value})
    assert sample.shows(plan) == sample.expected
    base, _ = orchestrator.api.sweep_plan_points({"lr": [1]}, **{**folders.base, name: sample.value})
    assert sample.shows(base) == sample.expected


def test_the_api_refuses_a_keyword_no_place_knows(no_profile_env: None) -> None:
    """A keyword outside the declaration is Python's own TypeError, before anything (a login host
    included) is reached: never dropped on the way, as ``container_image`` was."""
    for call in (orchestrator.make_plan, orchestrator.submit, orchestrator.sweep):
        with pytest.raises(
            TypeError, match=rf"^{call.__name__}\(\) got an unexpected keyword argument 'imag'"
        ):
            call(script="job.py", profile="local", imag="x", grid={"a": [1]})
    with pytest.raises(TypeError, match=r"^make_plan\(\) missing 1 required keyword-only argument: 'script'"):
        orchestrator.make_plan(profile="local")


# ------------------------------------------------------------------- the command line


def test_the_flags_are_the_declaration() -> None:
    """``submit``, ``sweep`` and ``render`` offer a flag per keyword with its help, in declaration
    order (the strategy options' flags where ``options`` stands)."""
    for command in ("submit", "sweep", "render"):
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        actions = {a.dest: a for a in sub._actions}
        for k in KEYWORDS:
            if k.spec.form in ("value", "switch", "each"):
                assert actions[k.name].option_strings == [k.flag], (command, k.name)
                assert actions[k.name].help == k.spec.help, (command, k.name)
            elif k.spec.form == "option":
                assert actions[k.name].option_strings == [k.flag], (command, k.name)
        flags = [a.dest for a in sub._actions if a.dest in R.KEYWORDS_BY_NAME]
        assert flags == [k.name for k in KEYWORDS if k.spec.form in ("value", "switch", "each", "option")]
        assert actions["script_and_args"].help == R.KEYWORDS_BY_NAME["script"].spec.help


@pytest.mark.parametrize("name", SAMPLED)
def test_the_command_line_carries_each_keyword(
    name: str, samples: dict[str, Sample], folders: Folders, no_profile_env: None
) -> None:
    sample = samples[name]
    args = build_parser("submit").parse_args(_argv(folders, sample, name))
    assert sample.shows(plan_from_args(args)) == sample.expected


def test_the_command_line_and_the_api_make_one_request(folders: Folders, no_profile_env: None) -> None:
    """The flags of every sample at once are the request of every keyword at once."""
    skip = {"profile", "profiles_dir", "script", "args"}
    words = ["submit", "--profile", "probe", "--profiles-dir", str(folders.first)]
    keywords = dict(folders.base)
    for name, sample in _samples(folders).items():
        if name not in skip:
            words += sample.words
            keywords[name] = sample.value
    from_flags = request_from_args(build_parser("submit").parse_args([*words, "--", "job.py"])).checked()
    from_keywords = JobRequest(**keywords).checked()
    assert from_flags.given_options() == from_keywords.given_options()
    assert dataclasses.replace(from_flags, options=None) == dataclasses.replace(from_keywords, options=None)


# ------------------------------------------------------------------- the planning path


def test_build_plan_is_fed_by_the_declaration() -> None:
    """Every keyword of ``build_plan`` past the profile and the options comes from one keyword of the
    request; the others the planning path reads itself (the profile, its image, the options)."""
    fed = [k.spec.plan for k in KEYWORDS if k.spec.plan is not None]
    params = list(inspect.signature(build_plan).parameters)
    assert params[:3] == ["profile_name", "profile", "options"]
    assert sorted(fed) == sorted(params[3:])
    read_by_planning = {k.name for k in KEYWORDS if k.spec.plan is None}
    assert read_by_planning == {"profile", "profiles_dir", "strategy", "options", "container_image"}
    assert set(dataclasses.fields(LaunchPlan)[i].name for i in range(3)) == {
        "profile_name",
        "profile",
        "options",
    }
    assert set(params[3:]) <= {f.name for f in dataclasses.fields(LaunchPlan)}


@pytest.mark.parametrize("name", SAMPLED)
def test_the_planning_path_carries_each_keyword(
    name: str, samples: dict[str, Sample], folders: Folders, no_profile_env: None
) -> None:
    sample = samples[name]
    plan = plan_request(JobRequest(**{**folders.base, name: sample.value}))
    assert sample.shows(plan) == sample.expected
    again = LaunchPlan.from_json(plan.to_json())  # and the run directory keeps it
    assert sample.shows(again) == sample.expected


@pytest.mark.parametrize("name", SAMPLED)
def test_each_keyword_is_checked(name: str, folders: Folders) -> None:
    """A value of the wrong type is a one-line UserError naming the keyword (or its flag)."""
    hint = typing.get_type_hints(JobRequest)[name]
    bad = "one string" if hint == Sequence[str] else ["a list"] if hint in (str, str | None) else object()
    with pytest.raises(UserError) as info:
        JobRequest(**{**folders.base, name: bad}).checked()
    message = str(info.value)
    assert message.startswith((f"{name}", R.KEYWORDS_BY_NAME[name].flag)) and "\n" not in message


# ------------------------------------------------------------------- the login host's command line


@pytest.mark.parametrize("name", SAMPLED)
def test_the_login_host_gets_each_keyword(
    name: str, samples: dict[str, Sample], folders: Folders, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plan_flags`` (what a remote ``submit``/``sweep`` sends) parsed by the login host's own
    ``submit`` makes the same plan. ``profiles_dir`` is a folder on the laptop and stays there: the
    login host finds the profile in its own folders (here: ``$ORCHESTRATOR_PROFILES``)."""
    sample = samples[name]
    monkeypatch.delenv("ORCHESTRATOR_PROFILE", raising=False)
    monkeypatch.setenv("ORCHESTRATOR_PROFILES", str(folders.first))
    words = plan_flags(JobRequest(**{**folders.base, name: sample.value}).checked())
    if not R.KEYWORDS_BY_NAME[name].spec.sent:
        assert R.KEYWORDS_BY_NAME[name].flag not in words and sample.value not in words
        return
    plan = plan_from_args(build_parser("submit").parse_args(["submit", *words]))
    assert sample.shows(plan) == sample.expected


def test_the_strategy_keyword_wins_on_the_login_host_too(folders: Folders) -> None:
    """``strategy=`` over ``options={"strategy": ...}``, as a local plan reads them; either alone is sent."""
    both = JobRequest(script="job.py", profile="p", strategy="ddp", options={"strategy": "full_shard"})
    assert plan_flags(both).count("--strategy") == 1 and "ddp" in plan_flags(both)
    alone = JobRequest(script="job.py", profile="p", options={"strategy": "full_shard", "wrap_cls": None})
    words = plan_flags(alone)
    assert words[words.index("--strategy") + 1] == "full_shard" and "--wrap-cls" not in words


# ------------------------------------------------------------------- the package's top


def test_user_error_is_importable_from_the_package_top(no_profile_env: None) -> None:
    """The README's API example catches ``orchestrator.UserError``: the same class every refusal raises."""
    from orchestrator import UserError as top

    assert top is orchestrator.UserError is UserError
    with pytest.raises(orchestrator.UserError, match="^nodes: expected an integer"):
        orchestrator.make_plan(script="job.py", profile="local", nodes=0)
