"""The Python API checks its input at its edge, with the CLI's checks (orchestrator/config/inputs.py),
before anything is created: a wrong type or value is a UserError, never another exception, never a
job id used up or a run directory made (issue #35 item 7; #27's float in ``args``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchestrator
from orchestrator.contract.errors import UserError
from tests.helpers.cli import REPO, kill_tree

QUICK = str(REPO / "tests" / "scripts" / "rank_probe.py")
TRAIN = str(REPO / "train" / "train.py")


@pytest.fixture
def api_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_RUNS", str(tmp_path / "runs"))
    yield tmp_path
    for pids in (tmp_path / "runs").glob("*/local_pids.json"):
        for pid in json.loads(pids.read_text()).values():
            kill_tree(int(pid))


def _nothing_created(root: Path) -> None:
    runs = root / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


#: keyword -> bad value, and a word of the message it must give.
BAD_SUBMIT: list[tuple[dict[str, Any], str]] = [
    ({"script": 5}, "script: expected a path"),
    ({"script": None}, "script: expected a path"),
    ({"nodes": "2"}, "nodes: expected an integer"),
    ({"nodes": 1.5}, "nodes: expected an integer"),
    ({"nodes": True}, "nodes: expected an integer"),
    ({"nodes": 0}, "nodes: expected an integer"),
    ({"procs_per_node": "2"}, "procs_per_node: expected an integer"),
    ({"options": ["x"]}, "options: expected a mapping"),
    ({"options": {"nope": 1}}, "unknown option 'nope'"),
    ({"args": "--max-steps 5"}, "args: expected a list of strings, not the string"),
    ({"args": [None]}, "args[0]: expected strings"),
    ({"args": [float("nan")]}, "args[0]: expected strings"),
    ({"args": 7}, "args: expected a list"),
    ({"after": "local-1"}, "after: expected a list of strings"),
    ({"max_requeues": 1000}, "--max-requeues: expected an integer from 0 to 100"),
    ({"max_requeues": "3"}, "--max-requeues: expected an integer"),
    ({"hang_timeout": 0}, "--hang-timeout: expected seconds from 1 to 86400"),
    ({"hang_timeout": 2.5}, "--hang-timeout: expected seconds"),
    ({"time": "99999999-00:00:00"}, "--time: expected at most 366 days"),
    ({"time": "99:99:99"}, "--time: expected minutes and seconds 0-59"),
    ({"time": 60}, "time: expected a string"),
    ({"auto_resume": "yes"}, "auto_resume: expected True or False"),
    ({"profile": 3}, "profile: expected a string"),
    ({"strategy": ["ddp"]}, "strategy: expected a string"),
    ({"name": 1}, "name: expected a string"),
    ({"exclude": ["n1"]}, "exclude: expected a string"),
    ({"profiles_dir": 1}, "profiles_dir: expected a path"),
]


@pytest.mark.parametrize(
    "bad, words",
    BAD_SUBMIT,
    ids=[next(iter(b)) + "-" + repr(next(iter(b.values())))[:20] for b, _ in BAD_SUBMIT],
)
def test_bad_submit_input_is_a_user_error_before_anything(
    api_env: Path, bad: dict[str, Any], words: str
) -> None:
    kwargs: dict[str, Any] = {"script": QUICK, "profile": "local", **bad}
    with pytest.raises(UserError, match=None) as caught:
        orchestrator.submit(**kwargs)
    assert words in str(caught.value), str(caught.value)
    _nothing_created(api_env)


BAD_SWEEP: list[tuple[dict[str, Any], str]] = [
    ({"grid": None}, "grid: expected a non-empty mapping"),
    ({"grid": {}}, "grid: expected a non-empty mapping"),
    ({"grid": {"lr": "1e-3"}}, "expected a list of values, got the string '1e-3'"),
    ({"grid": {"lr": []}}, "non-empty list"),
    ({"grid": {"lr": [1, 1]}}, "listed twice"),
    ({"grid": {"l r": [1]}}, "names that are words"),
    ({"grid": {"lr": [None]}}, "expected strings"),
    ({"grid": {"lr": [1]}, "max_parallel": 0}, "max_parallel: expected an integer >= 1"),
    ({"grid": {"lr": [1]}, "max_parallel": "2"}, "max_parallel: expected an integer"),
]


@pytest.mark.parametrize("bad, words", BAD_SWEEP)
def test_bad_sweep_input_is_a_user_error_before_anything(
    api_env: Path, bad: dict[str, Any], words: str
) -> None:
    with pytest.raises(UserError) as caught:
        orchestrator.sweep(script=QUICK, profile="local", args=["--lr", "{lr}"], **bad)
    assert words in str(caught.value), str(caught.value)
    _nothing_created(api_env)


def test_grid_values_are_never_re_split_and_numbers_are_words() -> None:
    base, grid = orchestrator.api.sweep_plan_points({"lr": ["a,b"], "wd": [1e-3, 2]}, script=QUICK)
    assert grid == {"lr": ["a,b"], "wd": ["0.001", "2"]}
    plan = orchestrator.make_plan(script=QUICK, args=["--lr", 3e-4, 5], hang_timeout=30)
    assert plan.script_args == ["--lr", "0.0003", "5"] and plan.hang_timeout == 30


def test_wait_and_cancel_refuse_what_the_cli_refuses(api_env: Path) -> None:
    job = orchestrator.submit(script=QUICK, profile="local", nodes=1, procs_per_node=1)
    for bad in ("5", float("nan"), -1, 0, float("inf"), True):
        with pytest.raises(UserError, match="timeout: expected"):
            job.wait(timeout=bad)
    with pytest.raises(UserError, match="poll: expected"):
        job.wait(timeout=5, poll=0)
    for sig in (0, 99999, "NOPE", 1.5, True):
        with pytest.raises(UserError, match="signal"):
            job.cancel(sig)  # type: ignore[arg-type]
    assert job.wait(timeout=120, poll=0.2).is_terminal()  # cancel(0) did not stop it


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=12),
    st.lists(st.one_of(st.text(max_size=6), st.integers(), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2), st.binary(max_size=4),
)  # fmt: skip
_KEYS = ["script", "args", "profile", "strategy", "nodes", "procs_per_node", "name", "time", "max_requeues",
         "auto_resume", "exclude", "after", "options", "hang_timeout"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(_KEYS), _ANY, min_size=1, max_size=4))
def test_api_fuzz_user_error_or_job_never_debris(api_env: Path, bad: dict[str, Any]) -> None:
    """Arbitrary types for any keyword of ``submit``: a UserError with nothing created, or a job
    (cancelled at once), never another exception."""
    kwargs: dict[str, Any] = {"script": QUICK, "profile": "local", **bad}
    runs = api_env / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    try:
        job = orchestrator.submit(**kwargs)
    except UserError:
        after = set(runs.iterdir()) if runs.exists() else set()
        assert after == before
        return
    try:
        assert job.run_dir.is_dir()
        assert not isinstance(kwargs.get("nodes"), float | str | bool)
        assert not isinstance(kwargs.get("args"), str)
    finally:
        job.cancel()


def test_a_range_of_grid_values_is_a_list_of_them() -> None:
    """``grid={"seed": range(100)}`` (the suite's 100-task sweep) is 100 values, as a list would be."""
    from orchestrator.config.inputs import grid

    assert grid({"seed": range(3), "lr": (1e-3,)}) == {"seed": ["0", "1", "2"], "lr": ["0.001"]}
