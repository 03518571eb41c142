"""Every public function of the Python API and every method of its handles checks each argument at
the door (issue #41 item 7): a wrong type or value is a UserError naming the call and the argument,
raised before anything runs, and nothing is created (no registry, no folder, no run directory). A
``home`` without a registry is refused by the calls that read, never given a new empty registry.

Nothing here trains: each bad argument is refused before any job is looked up or started."""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import orchestrator
from orchestrator import api
from orchestrator.config.job_request import JobRequest
from orchestrator.contract.errors import UserError
from orchestrator.registry.store import Registry
from tests.helpers.cli import REPO

QUICK = str(REPO / "tests" / "scripts" / "rank_probe.py")
NAN, INF = math.nan, math.inf


@dataclass
class Where:
    """The folders of one test: a home with a registry, and places that must stay as they are."""

    root: Path

    @property
    def home(self) -> Path:  # holds a registry (made by the fixture)
        return self.root / "home"

    @property
    def default_home(self) -> Path:  # $ORCHESTRATOR_HOME: never made by a refused call
        return self.root / "default_home"

    @property
    def fresh(self) -> Path:  # a folder that does not exist: a mistyped home
        return self.root / "fresh"

    @property
    def empty(self) -> Path:  # a folder that exists and holds no registry
        return self.root / "empty"

    @property
    def out(self) -> Path:  # export's --out
        return self.root / "out"

    def job(self, home: Any = "<HOME>") -> api.Job:
        return api.Job("local-1", self.root / "runs" / "r1", resolve(self, home))

    def sweep(self, home: Any = "<HOME>") -> api.Sweep:
        return api.Sweep("local-9", self.root / "runs" / "s1", resolve(self, home))

    def snapshot(self) -> dict[str, Any]:
        """What must not change when a call is refused."""
        return {
            "home": sorted(p.name for p in self.home.iterdir()),
            "empty": sorted(p.name for p in self.empty.iterdir()),
            "made": [
                p.name for p in (self.fresh, self.default_home, self.out, self.root / "runs") if p.exists()
            ],
        }


def resolve(where: Where, value: Any) -> Any:
    """The placeholders of the tables: ``<HOME>`` and the like, as this test's paths or objects."""
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return {
            "<HOME>": lambda: where.home,
            "<FRESH>": lambda: where.fresh,
            "<EMPTY>": lambda: where.empty,
            "<OUT>": lambda: where.out,
            "<PLAN>": lambda: api.make_plan(script=QUICK, profile="local"),
            "<REGISTRY>": lambda: Registry.open(where.home),
            "<REQUEST>": lambda: JobRequest(script=QUICK, profile="local"),
        }[value]()
    return value


@pytest.fixture(scope="module")
def a_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry made once per module; each test gets a copy (fast: no schema set-up per case)."""
    home = tmp_path_factory.mktemp("registry")
    Registry.open(home).close()
    return home


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, a_registry: Path) -> Where:
    w = Where(tmp_path)
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(w.default_home))
    monkeypatch.setenv("ORCHESTRATOR_RUNS", str(tmp_path / "runs"))
    shutil.copytree(a_registry, w.home)
    w.empty.mkdir()
    return w


# The classes of bad input, per kind of argument.
JOB_ID = [None, 5, ["local-1"], "", "  ", b"local-1"]
PATH = [None, 5, ["a"], ""]
OPTIONAL_PATH = [5, ["a"], ""]
UNTIL = [None, 5, "", "started", "End"]  # a wait is for "end" or "checkpoint"
FLAG = ["no", "yes", 1, 0, None]
SECONDS = ["10", NAN, INF, -INF, -1, 0, True, None]
OPTIONAL_SECONDS = ["10", NAN, INF, -1, 0, True]
COUNT = ["1", 1.5, -1, True, NAN]  # an optional integer >= 0
HOME = [5, "", ["h"], "<FRESH>", "<EMPTY>"]
STREAM = [5, "stdout"]
REGISTRY_ARG = ["registry.db", 5]
PLAN = [None, "plan", {"script": QUICK}]
JOB_IDS = ["local-1", [None], [""], 5, None]

#: call name -> (the call: where, keywords -> result; its valid keywords; argument -> bad values).
#: Valid keywords are what the call needs besides the one argument made bad.
Call = Callable[..., Any]
TABLE: dict[str, tuple[Call, dict[str, Any], dict[str, list[Any]]]] = {
    "cost": (
        lambda w, **k: api.cost(**k),
        {"target": "local-1", "home": "<HOME>"},
        {"target": JOB_ID, "whole_run": FLAG, "timeout_s": SECONDS, "home": HOME},
    ),
    "export": (
        lambda w, **k: api.export(**k),
        {"run": "local-1", "out": "<OUT>", "home": "<HOME>"},
        {
            "run": [5, ["local-1"], "", 1.5],
            "out": PATH,
            "fmt": [None, "onnx", ["hf"], 1],
            "step": COUNT,
            "checkpoint": OPTIONAL_PATH,
            "dtype": [None, "fp16", ["bf16"]],
            "verify": FLAG,
            "config": OPTIONAL_PATH,
            "say": ["print", 5],
            "home": HOME,
        },
    ),
    "get_job": (
        lambda w, **k: api.get_job(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {"job_id": JOB_ID, "home": HOME},
    ),
    "get_sweep": (
        lambda w, **k: api.get_sweep(**k),
        {"sweep_id": "local-9", "home": "<HOME>"},
        {"sweep_id": JOB_ID, "home": HOME},
    ),
    "cancel": (
        lambda w, **k: api.cancel(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {"job_id": JOB_ID, "sig": [0, 99999, "NOPE", 1.5, True], "home": HOME},
    ),
    "resume": (
        lambda w, **k: api.resume(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {
            "job_id": JOB_ID,
            "home": HOME,
            "nodes": ["2", 0, 1.5, True],
            "procs_per_node": ["2", 0, 1.5],
            "strategy": [5, ["ddp"]],
            "profile": [5, ["local"]],
            "profiles_dir": OPTIONAL_PATH,
        },
    ),
    "status": (
        lambda w, **k: api.status(**k),
        {"job_ids": ["local-1"], "home": "<HOME>"},
        {"job_ids": JOB_IDS, "timeout_s": SECONDS, "registry": REGISTRY_ARG, "home": HOME},
    ),
    "wait": (
        lambda w, **k: api.wait(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {
            "job_id": JOB_ID,
            "poll": SECONDS,
            "timeout": OPTIONAL_SECONDS,
            "out": STREAM,
            "registry": REGISTRY_ARG,
            "home": HOME,
            "until": UNTIL,
        },
    ),
    "wait_sweep": (
        lambda w, **k: api.wait_sweep(**k),
        {"sweep_id": "local-9", "home": "<HOME>"},
        {"sweep_id": JOB_ID, "poll": SECONDS, "timeout": OPTIONAL_SECONDS, "out": STREAM, "home": HOME},
    ),
    "logs": (
        lambda w, **k: api.logs(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {
            "job_id": JOB_ID,
            "follow": FLAG,
            "node": COUNT,
            "rank": COUNT,
            "attempt": COUNT,
            "tail": COUNT,
            "interval": SECONDS,
            "out": STREAM,
            "err": STREAM,
            "resume_from": ["{}", [1]],
            "framed": FLAG,
            "home": HOME,
        },
    ),
    "plot": (
        lambda w, **k: api.plot(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {"job_id": JOB_ID, "output": OPTIONAL_PATH, "home": HOME},
    ),
    "stacks": (
        lambda w, **k: api.stacks(**k),
        {"job_id": "local-1", "home": "<HOME>"},
        {"job_id": JOB_ID, "home": HOME},
    ),
    "list_jobs": (
        lambda w, **k: api.list_jobs(**k),
        {"home": "<HOME>"},
        {
            "state": [5, "", "NOPE", ["RUNNING"]],
            "since": ["yesterday", NAN, INF, True],
            "registry": REGISTRY_ARG,
            "home": HOME,
        },
    ),
    "list_sweeps": (
        lambda w, **k: api.list_sweeps(**k),
        {"home": "<HOME>"},
        {"registry": REGISTRY_ARG, "home": HOME},
    ),
    "find_sweep": (
        lambda w, **k: api.find_sweep(**k),
        {"sweep_id": "local-9", "home": "<HOME>"},
        {"sweep_id": JOB_ID, "registry": REGISTRY_ARG, "home": HOME},
    ),
    "get_sweep_record": (
        lambda w, **k: api.get_sweep_record(**k),
        {"sweep_id": "local-9", "home": "<HOME>"},
        {"sweep_id": JOB_ID, "registry": REGISTRY_ARG, "home": HOME},
    ),
    "reconcile": (
        lambda w, **k: api.reconcile(**k),
        {"home": "<HOME>"},
        {"registry": REGISTRY_ARG, "home": HOME},
    ),
    "open_registry": (
        lambda w, **k: api.open_registry(**k),
        {"home": "<HOME>"},
        {"home": [5, "", ["h"]], "create": FLAG},
    ),
    "parse_after": (lambda w, **k: api.parse_after(**k), {"text": "12"}, {"text": [None, 12, ["12"], ""]}),
    "plan_request": (
        lambda w, **k: api.plan_request(**k),
        {},
        {"request": [None, {"script": QUICK}, "<PLAN>"]},
    ),
    "dry_run": (lambda w, **k: api.dry_run(**k), {}, {"plan": PLAN}),
    "render_files": (
        lambda w, **k: api.render_files(**k),
        {"plan": "<PLAN>"},
        {"plan": PLAN, "node_rank": COUNT, "python": OPTIONAL_PATH},
    ),
    "resume_plan": (
        lambda w, **k: api.resume_plan(**k),
        {"previous": "<PLAN>"},
        {
            "previous": PLAN,
            "nodes": ["2", 0, 1.5],
            "strategy": [5],
            "profile": [5],
            "profiles_dir": OPTIONAL_PATH,
        },
    ),
    "submit_plan": (
        lambda w, **k: api.submit_plan(**k),
        {"plan": "<PLAN>"},
        {"plan": PLAN, "snapshot": FLAG, "registry": REGISTRY_ARG},
    ),
    "submit": (
        lambda w, **k: api.submit(script=QUICK, profile="local", **k),
        {},
        {"snapshot": FLAG},
    ),
    "sweep": (
        lambda w, **k: api.sweep(script=QUICK, profile="local", args=["--lr", "{lr}"], **k),
        {"grid": {"lr": [1]}},
        {"grid": [None, {}, {"lr": "1"}, ["lr"]], "max_parallel": [0, "2", 1.5, True]},
    ),
    "dry_run_sweep": (
        lambda w, **k: api.dry_run_sweep(**k),
        {"base": "<PLAN>", "grid": {"lr": ["1"]}},
        {"base": PLAN, "grid": [None, {}, {"lr": "1"}, ["lr"]], "max_parallel": [0, "2", 1.5, True]},
    ),
    "submit_sweep_plan": (
        lambda w, **k: api.submit_sweep_plan(**k),
        {"base": "<PLAN>", "grid": {"lr": ["1"]}, "max_parallel": None},
        {
            "base": PLAN,
            "grid": [None, {}, {"lr": "1"}],
            "max_parallel": [0, "2", 1.5],
            "registry": REGISTRY_ARG,
        },
    ),
    "check_profile": (
        lambda w, **k: api.check_profile(**k),
        {"name": "local", "path": "p.yaml", "profile": None},
        {"name": [None, 5, ""], "path": PATH},
    ),
    "Job": (
        lambda w, **k: api.Job(**k),
        {"job_id": "local-1", "run_dir": "runs/r1"},
        {"job_id": JOB_ID, "run_dir": PATH, "_home": [5, ["h"], ""]},
    ),
    "Job.status": (lambda w, **k: w.job().status(**k), {}, {"timeout_s": SECONDS}),
    "Job.wait": (
        lambda w, **k: w.job().wait(**k),
        {},
        {"timeout": OPTIONAL_SECONDS, "poll": SECONDS, "out": STREAM, "until": UNTIL},
    ),
    "Job.logs": (lambda w, **k: w.job().logs(**k), {}, {"node": [*COUNT, None], "attempt": COUNT}),
    "Job.cancel": (lambda w, **k: w.job().cancel(**k), {}, {"signal": [0, "NOPE", 1.5, True]}),
    "Job.resume": (
        lambda w, **k: w.job().resume(**k),
        {},
        {
            "nodes": ["2", 0, 1.5],
            "procs_per_node": ["2", 0],
            "strategy": [5],
            "profile": [5],
            "profiles_dir": OPTIONAL_PATH,
        },
    ),
    "Sweep": (
        lambda w, **k: api.Sweep(**k),
        {"sweep_id": "local-9", "sweep_dir": "runs/s1"},
        {"sweep_id": JOB_ID, "sweep_dir": PATH, "_home": [5, ["h"], ""]},
    ),
    "Sweep.status": (
        lambda w, **k: w.sweep().status(**k),
        {},
        {"metric": [None, "accuracy", ["loss"], 5], "timeout_s": SECONDS},
    ),
    "Sweep.wait": (lambda w, **k: w.sweep().wait(**k), {}, {"timeout": OPTIONAL_SECONDS, "poll": SECONDS}),
    "Sweep.resume_failed": (
        lambda w, **k: w.sweep().resume_failed(**k),
        {},
        {"nodes": ["2", 0, 1.5], "strategy": [5], "profiles_dir": OPTIONAL_PATH},
    ),
}

#: A handle whose home holds no registry: each method that reads the registry refuses it.
HANDLE_HOME: dict[str, Call] = {
    "Job.status": lambda j: j.status(),
    "Job.wait": lambda j: j.wait(timeout=1),
    "Job.cancel": lambda j: j.cancel(),
    "Job.resume": lambda j: j.resume(),
    "Sweep.jobs": lambda s: s.jobs,
    "Sweep.status": lambda s: s.status(),
    "Sweep.wait": lambda s: s.wait(timeout=1),
    "Sweep.resume_failed": lambda s: s.resume_failed(),
    "Sweep.cancel": lambda s: s.cancel(),
}


def _cases() -> list[Any]:
    out = []
    for call, (_, _, bad) in TABLE.items():
        for arg, values in bad.items():
            for value in values:
                out.append(pytest.param(call, arg, value, id=f"{call}-{arg}-{value!r}"[:60]))
    return out


def _names(message: str, arg: str) -> bool:
    """The message names the argument (``home: ...``, ``job_ids[0]: ...``; a signal as ``--signal``)."""
    name = {"_home": "home", "sig": "signal"}.get(arg, arg)
    return re.search(rf"(^|[ -]){re.escape(name)}[:\[ ]", message) is not None


@pytest.mark.parametrize("call, arg, bad", _cases())
def test_a_bad_argument_is_a_user_error_naming_it_and_nothing_is_created(
    where: Where, call: str, arg: str, bad: Any
) -> None:
    func, good, _ = TABLE[call]
    kwargs = {k: resolve(where, v) for k, v in good.items()}
    kwargs[arg] = resolve(where, bad)
    if call == "check_profile":
        from orchestrator.config.profile.load import load_profile

        kwargs["profile"] = load_profile("local", None)[2]
    before = where.snapshot()
    try:
        with pytest.raises(UserError) as caught:
            func(where, **kwargs)
    finally:
        for value in kwargs.values():
            if isinstance(value, Registry):
                value.close()
    message = str(caught.value)
    assert _names(message, arg), message
    if bad in ("<FRESH>", "<EMPTY>"):
        assert "no registry" in message or "does not exist" in message, message
    assert where.snapshot() == before, message


@pytest.mark.parametrize("method", list(HANDLE_HOME))
@pytest.mark.parametrize("home", ["<FRESH>", "<EMPTY>"])
def test_a_handle_whose_home_holds_no_registry_refuses_and_creates_none(
    where: Where, method: str, home: str
) -> None:
    handle = where.job(home) if method.startswith("Job.") else where.sweep(home)
    before = where.snapshot()
    with pytest.raises(UserError, match=rf"^{method}: home: .*(no registry|does not exist)"):
        HANDLE_HOME[method](handle)
    assert where.snapshot() == before


def test_the_issue_s_examples(where: Where) -> None:
    with pytest.raises(UserError, match=r"^cost: target: expected a job id, a run directory or a sweep id"):
        api.cost(None)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"^cost: target: .*got \['local-1'\]"):
        api.cost(["local-1"])  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"^export: out: expected a path"):
        api.export("local-1", None)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"^export: verify: expected True or False, got 'no'"):
        api.export("local-1", where.out, verify="no")  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"^cost: timeout_s: expected a number of seconds > 0, got '10'"):
        api.cost("local-1", timeout_s="10")  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"^cost: home: .* does not exist; .*nothing was created"):
        api.cost("local-1", home=where.fresh)
    assert where.snapshot()["made"] == []


def test_good_arguments_still_pass_the_door(where: Where) -> None:
    """A str or a path for ``home`` and a run directory, a registry made by ``open_registry``: the
    call goes on to its own answer (an unknown id), and ``open_registry`` still creates on request."""
    assert api.list_jobs(home=str(where.home)) == []
    assert api.list_sweeps(home=where.home) == []
    with pytest.raises(UserError, match="unknown job id"):
        api.get_job("local-1", home=where.home)
    with pytest.raises(UserError, match="unknown job id"):
        api.cost("local-1", whole_run=True, timeout_s=1, home=str(where.home))
    with api.open_registry(where.home) as registry:
        assert api.list_jobs(state="RUNNING", since=0, registry=registry) == []
    made = where.root / "made"
    api.open_registry(made).close()  # the open that creates, asked for
    assert (made / "registry.db").is_file()
    with pytest.raises(UserError, match="^home: .* does not exist"):
        api.open_registry(where.fresh, create=False)
    assert not where.fresh.exists()
    job = orchestrator.Job("local-1", str(where.root / "r"))
    assert job.run_dir == where.root / "r" and job.logs(node=0) == ""
