"""Bad input through the real CLI: every case exits 2 with one clear line and no traceback.

Each case runs ``python -m orchestrator ...`` as a subprocess in its own temporary
folder, whose ``cluster_profiles/`` holds the case's bad YAML (profiles found there
override the built-ins by name). The subprocesses run concurrently in one
module-scoped fixture; each parametrized test then checks its own result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.cli import REPO


@dataclass(frozen=True)
class Case:
    id: str
    args: list[str]
    """CLI arguments after ``python -m orchestrator``."""
    profile: str | bytes | None = None
    """Written to ``cluster_profiles/<id>.yaml`` in the case's folder (``--profile <id>``)."""
    expect: tuple[str, ...] = ()
    """Substrings of the error line ("{file}" is replaced by the profile's path)."""
    exact: str | None = None
    """The whole error line, when the wording itself is the contract."""
    names_file: bool = True
    """The error line names ``cluster_profiles/<id>.yaml`` (profile cases only)."""
    extra_files: dict[str, str | bytes] = field(default_factory=dict)
    """More files in the case's folder (name -> content)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for the case (after the isolated defaults)."""


def yaml_case(id: str, text: str | bytes, *expect: str, exact: str | None = None) -> Case:
    """A bad profile file, rendered with ``render --profile <id>``."""
    return Case(id, ["render", "--profile", id], profile=text, expect=expect, exact=exact)


def cli_case(
    id: str,
    args: list[str],
    *expect: str,
    profile: str | None = None,
    names_file: bool = False,
    env: dict[str, str] | None = None,
    files: dict[str, str | bytes] | None = None,
) -> Case:
    return Case(
        id,
        args,
        profile=profile,
        expect=expect,
        names_file=names_file,
        env=env or {},
        extra_files=files or {},
    )


SLURM = "scheduler: slurm\npartition: gpu\n"
V100 = "scheduler: slurm\npartition: gpu\nnodes: {default: 1, max: 4}\ngpus_per_node: 4\ngpu_type: v100\n"

CASES: list[Case] = [
    # --- malformed YAML -------------------------------------------------------------------
    yaml_case("yaml_unclosed_flow", "scheduler: local\nnodes: [1,\n", "{file}: line ", "malformed YAML"),
    yaml_case("yaml_tab_indent", "scheduler: local\nnodes:\n\tmax: 2\n", "{file}: line ", "malformed YAML"),
    yaml_case("yaml_unclosed_quote", 'scheduler: "local\n', "{file}: line ", "malformed YAML"),
    yaml_case(
        "yaml_bad_indent", "scheduler: local\n  nodes: 2\n nodes: 3\n", "{file}: line ", "malformed YAML"
    ),
    yaml_case(
        "yaml_python_tag",
        "scheduler: !!python/object/apply:os.system ['touch pwned']\n",
        "{file}",
        "malformed YAML",
    ),
    yaml_case("yaml_top_level_list", "- scheduler\n- local\n", "{file}: (top level)", "mapping", "got list"),
    yaml_case("yaml_top_level_scalar", "just a string\n", "{file}: (top level)", "mapping", "got str"),
    yaml_case("yaml_empty", "", "{file}: (top level)", "empty file"),
    yaml_case("yaml_int_key", "scheduler: local\n1: x\n", "{file}: (top level)", "string keys", "1"),
    yaml_case("yaml_not_utf8", b"scheduler: local\ndescription: \xff\xfe\n", "{file}: cannot read profile"),
    # --- wrong types ------------------------------------------------------------------------
    yaml_case(
        "nodes_max_two",
        "scheduler: local\nnodes:\n  max: two\n",
        exact="cluster_profiles/nodes_max_two.yaml: nodes.max: expected an integer, got 'two'",
    ),
    yaml_case(
        "gpus_quoted", SLURM + 'gpus_per_node: "8"\n', "{file}: gpus_per_node: expected an integer", "'8'"
    ),
    yaml_case(
        "gpus_float", SLURM + "gpus_per_node: 1.5\n", "{file}: gpus_per_node: expected an integer", "1.5"
    ),
    yaml_case("exclusive_string", SLURM + 'exclusive: "yes"\n', "{file}: exclusive: expected true or false"),
    yaml_case("nodes_scalar", "scheduler: local\nnodes: 2\n", "{file}: nodes: expected a mapping"),
    yaml_case("setup_string", SLURM + "setup: module load cuda\n", "{file}: setup: expected a list"),
    yaml_case("env_list", SLURM + "env: [A, B]\n", "{file}: env: expected a mapping"),
    yaml_case(
        "env_value_list", SLURM + "env: {X: [1, 2]}\n", "{file}: env.X: expected a string, an integer or"
    ),
    yaml_case("env_bad_name", SLURM + "env: {1BAD: x}\n", "{file}: env:", "'1BAD'"),
    yaml_case("time_limit_words", SLURM + "time_limit: 4 hours\n", "{file}: time_limit:", "'4 hours'"),
    yaml_case(
        "time_limit_sexagesimal", SLURM + "time_limit: 4:00:00\n", "{file}: time_limit: expected a string"
    ),
    yaml_case("mem_words", SLURM + "mem: lots\n", "{file}: mem:", "'lots'"),
    yaml_case("mem_trailing_newline", SLURM + 'mem: "480G\\n"\n', "{file}: mem:", "'480G\\n'"),
    yaml_case("scheduler_pbs", "scheduler: pbs\n", "{file}: scheduler: expected one of", "'pbs'"),
    yaml_case("scheduler_missing", "gpus_per_node: 0\n", "{file}: scheduler: missing required key"),
    yaml_case("slurm_no_partition", "scheduler: slurm\n", "{file}:", "partition: required"),
    yaml_case("partition_empty", 'scheduler: slurm\npartition: ""\n', "{file}: partition:", "single-line"),
    yaml_case("account_newline", SLURM + 'account: "a\\nb"\n', "{file}: account:", "single-line"),
    yaml_case(
        "nodes_default_gt_max", "scheduler: local\nnodes: {default: 3, max: 2}\n", "{file}: nodes:", "<= max"
    ),
    yaml_case(
        "nodes_max_zero", "scheduler: local\nnodes: {default: 1, max: 0}\n", "{file}: nodes.max:", ">= 1"
    ),
    yaml_case(
        "ports_reversed", "scheduler: local\nport_range: {start: 29600, end: 29500}\n", "{file}: port_range:"
    ),
    yaml_case(
        "port_privileged",
        "scheduler: local\nport_range: {start: 80, end: 29500}\n",
        "{file}: port_range.start",
    ),
    yaml_case(
        "signal_kill", SLURM + "signal: {name: KILL}\n", "{file}: signal.name: expected one of", "'KILL'"
    ),
    yaml_case(
        "extra_sbatch_managed", SLURM + "extra_sbatch: {nodes: 3}\n", "{file}: extra_sbatch:", "'nodes'"
    ),
    yaml_case(
        "extra_sbatch_bad_key", SLURM + "extra_sbatch: {Bad_Key: x}\n", "{file}: extra_sbatch:", "'Bad_Key'"
    ),
    yaml_case(
        "profile_procs_gt_gpus",
        SLURM + "gpus_per_node: 8\nprocs_per_node: 16\n",
        "{file}: procs_per_node: 16 is more than gpus_per_node (8)",
    ),
    yaml_case(
        "defaults_strategy_typo",
        "scheduler: local\ndefaults: {strategy: fulshard}\n",
        "{file}: defaults.strategy",
    ),
    yaml_case(
        "defaults_fsdp_3", "scheduler: local\ndefaults: {fsdp_version: 3}\n", "{file}: defaults.fsdp_version"
    ),
    # --- unknown keys: did-you-mean -----------------------------------------------------------
    yaml_case(
        "unknown_top_key",
        "scheduler: local\ngpus_per_nod: 2\n",
        exact="cluster_profiles/unknown_top_key.yaml: gpus_per_nod: unknown key (did you mean 'gpus_per_node'?)",
    ),
    yaml_case(
        "unknown_nested_key",
        "scheduler: local\nnodes: {maxx: 2}\n",
        "{file}: nodes.maxx: unknown key (did you mean 'max'?)",
    ),
    yaml_case(
        "unknown_defaults_key",
        "scheduler: local\ndefaults: {stratgy: ddp}\n",
        "{file}: defaults.stratgy: unknown key (did you mean 'strategy'?)",
    ),
    yaml_case(
        "unknown_key_no_guess", "scheduler: local\nzzzz: 1\n", "{file}: zzzz: unknown key (known keys:"
    ),
    yaml_case("unknown_key_named_int", "scheduler: local\nint: 1\n", "{file}: int: unknown key"),
    # --- impossible strategy combinations -----------------------------------------------------------
    cli_case(
        "hybrid_one_node",
        ["render", "--profile", "slurm_a100", "--strategy", "hybrid_shard", "--nodes", "1"],
        "--strategy hybrid_shard",
        "needs >= 2 nodes",
    ),
    cli_case(
        "hybrid_one_proc_per_node",
        ["render", "--profile", "slurm_test", "--strategy", "hybrid_shard_zero2"],
        "--strategy hybrid_shard_zero2",
        ">= 2 processes per node",
    ),
    Case(
        "hybrid_default_one_node",
        ["render", "--profile", "hybrid_default_one_node"],
        profile="scheduler: local\nprocs_per_node: 2\ndefaults: {strategy: hybrid_shard}\n",
        expect=("--strategy hybrid_shard", "needs >= 2 nodes", "{file}: defaults.strategy"),
    ),
    cli_case(
        "too_many_nodes", ["render", "--profile", "slurm_a100", "--nodes", "33"], "--nodes: 33", "nodes.max"
    ),
    cli_case(
        "bf16_on_v100",
        ["render", "--profile", "bf16_on_v100", "--mixed-precision", "bf16"],
        "--mixed-precision bf16",
        "v100",
        profile=V100,
    ),
    Case(
        "bf16_on_v100_from_defaults",
        ["render", "--profile", "bf16_on_v100_from_defaults"],
        profile=V100 + "defaults: {mixed_precision: bf16}\n",
        expect=("--mixed-precision bf16", "v100", "{file}: defaults.mixed_precision"),
    ),
    cli_case(
        "fp16_on_cpu", ["render", "--profile", "local", "--mixed-precision", "fp16"], "--mixed-precision fp16"
    ),
    cli_case(
        "offload_with_ddp",
        ["render", "--profile", "slurm_a100", "--strategy", "ddp", "--offload"],
        "--offload",
    ),
    cli_case(
        "offload_on_cpu_profile",
        ["render", "--profile", "local", "--strategy", "full_shard", "--offload"],
        "--offload",
        "no GPUs",
    ),
    cli_case(
        "act_ckpt_with_ddp",
        ["render", "--profile", "local", "--strategy", "ddp", "--activation-checkpointing"],
        "--activation-checkpointing",
    ),
    cli_case(
        "wrap_cls_with_ddp", ["render", "--profile", "local", "--wrap-cls", "Block"], "--wrap-cls", "ddp"
    ),
    cli_case(
        "fsdp2_no_shard",
        ["render", "--profile", "slurm_a100", "--strategy", "no_shard", "--fsdp-version", "2"],
        "--strategy no_shard",
        "FSDP2",
    ),
    cli_case(
        "fsdp1_full_state_dict_cpu",
        [
            "render",
            "--profile",
            "local",
            "--strategy",
            "full_shard",
            "--fsdp-version",
            "1",
            "--state-dict",
            "full",
        ],
        "--state-dict full",
        "CPU",
    ),
    cli_case(
        "procs_gt_gpus",
        ["render", "--profile", "slurm_a100", "--procs-per-node", "9"],
        "--procs-per-node: 9",
        "8 GPUs",
    ),
    # --- bad command-line values -----------------------------------------------------------------------
    cli_case("unknown_strategy", ["render", "--strategy", "zero3"], "--strategy", "'zero3'"),
    cli_case("nodes_zero", ["render", "--nodes", "0"], "--nodes", "'0'"),
    cli_case("nodes_word", ["render", "--nodes", "two"], "--nodes", "'two'"),
    cli_case("procs_zero", ["render", "--procs-per-node", "0"], "--procs-per-node", "'0'"),
    cli_case("fsdp_version_3", ["render", "--fsdp-version", "3"], "--fsdp-version", "3"),
    cli_case("mixed_precision_fp8", ["render", "--mixed-precision", "fp8"], "--mixed-precision", "'fp8'"),
    cli_case("state_dict_partial", ["render", "--state-dict", "partial"], "--state-dict", "'partial'"),
    cli_case(
        "unknown_profile",
        ["render", "--profile", "slurm_a10"],
        "--profile: unknown profile 'slurm_a10'",
        "(did you mean 'slurm_a100'?)",
    ),
    cli_case(
        "profile_path_missing", ["render", "--profile", "nowhere/x.yaml"], "nowhere/x.yaml", "not found"
    ),
    cli_case(
        "node_rank_too_high", ["render", "--profile", "slurm_a100", "--node-rank", "2"], "--node-rank", "2"
    ),
    cli_case(
        "node_rank_negative", ["render", "--profile", "slurm_a100", "--node-rank", "-1"], "--node-rank", "-1"
    ),
    cli_case("node_rank_word", ["render", "--node-rank", "first"], "--node-rank", "'first'"),
    cli_case("time_garbage", ["render", "--profile", "slurm_a100", "--time", "soon"], "--time", "'soon'"),
    cli_case(
        "time_trailing_newline", ["render", "--profile", "slurm_a100", "--time", "90\n"], "--time", "'90\\n'"
    ),
    cli_case(
        "name_newline", ["render", "--profile", "slurm_a100", "--name", "a\nb"], "--name", "single-line"
    ),
    # issue #35 item 9: accepted before, refused now with the range
    cli_case(
        "time_absurd_days",
        ["render", "--profile", "slurm_a100", "--time", "99999999-00:00:00"],
        "--time",
        "366 days",
    ),  # fmt: skip
    cli_case(
        "time_fields_out_of_range",
        ["render", "--profile", "slurm_a100", "--time", "99:99:99"],
        "--time",
        "0-59",
    ),  # fmt: skip
    cli_case(
        "max_requeues_over_cap",
        ["render", "--profile", "slurm_a100", "--max-requeues", "1000"],
        "--max-requeues",
        "0 to 100",
    ),  # fmt: skip
    cli_case("wait_timeout_nan", ["wait", "local-1", "--timeout", "nan"], "--timeout", "nan"),
    cli_case("wait_poll_inf", ["wait", "local-1", "--poll", "inf"], "--poll", "inf"),
    yaml_case("time_limit_out_of_range", "scheduler: local\ntime_limit: '99:99:99'\n", "time_limit", "0-59"),
    cli_case("name_empty", ["render", "--profile", "slurm_a100", "--name", ""], "--name", "non-empty"),
    cli_case("out_is_a_file", ["render", "--profile", "local", "--out", "afile"], "--out", "not a directory"),
    Case(
        "validate_bad_profile",
        ["profiles", "validate", "cluster_profiles/validate_bad_profile.yaml"],
        profile="scheduler: local\nnodes: {max: two}\n",
        expect=("{file}: nodes.max: expected an integer",),
    ),
    # Sweeps and dependencies (issue 15): refused before anything is made.
    cli_case("sweep_no_grid", ["sweep", "--", "afile"], "no grid", "--grid NAME=V1,V2"),
    cli_case("sweep_grid_no_equals", ["sweep", "--grid", "lr", "--", "afile"], "--grid 'lr'", "NAME=V1,V2"),
    cli_case(
        "sweep_grid_empty_value",
        ["sweep", "--grid", "lr=1,", "--", "afile"],
        "--grid 'lr=1,'",
        "no empty value",
    ),
    cli_case(
        "sweep_grid_twice",
        ["sweep", "--grid", "lr=1", "--grid", "lr=2", "--", "afile", "{lr}"],
        "--grid lr",
        "given twice",
    ),
    cli_case(
        "sweep_grid_unused",
        ["sweep", "--grid", "lr=1,2", "--", "afile", "--seed", "1"],
        "--grid lr",
        "no script argument uses {lr}",
    ),
    cli_case(
        "sweep_placeholder_unfilled",
        ["sweep", "--grid", "lr=1,2", "--", "afile", "--lr", "{lr}", "--seed", "{seed}"],
        "placeholder {seed} has no --grid seed=",
    ),
    cli_case(
        "sweep_yaml_missing",
        ["sweep", "--file", "nowhere.yaml", "--", "afile"],
        "--file nowhere.yaml",
        "cannot read",
    ),
    cli_case(
        "sweep_max_parallel_zero",
        ["sweep", "--max-parallel", "0", "--grid", "lr=1", "--", "afile", "{lr}"],
        "--max-parallel",
        "'0'",
    ),
    cli_case(
        "after_bad_syntax",
        ["submit", "--after", "12:sometimes", "--", "afile"],
        "--after '12:sometimes'",
        "JOB:ok or JOB:any",
    ),
    cli_case("after_local", ["submit", "--after", "12", "--", "afile"], "--after", "runs locally"),
    # issue #35 item 8: one line and exit 2, never a traceback
    cli_case(
        "sweep_file_not_utf8",
        ["sweep", "--file", "grid.yaml", "--", "afile", "{lr}"],
        "--file grid.yaml",
        "not UTF-8",
        files={"grid.yaml": b"grid:\n  lr: [\xff\xfe]\n"},
    ),
    cli_case("render_out_unwritable", ["render", "--out", "/proc/x"], "--out /proc/x", "cannot write"),
    # issue #35 item 9: accepted without complaint before
    cli_case(
        "exclude_local", ["submit", "--exclude", "n1", "--", "afile"], "--exclude n1", "no node to exclude"
    ),
    cli_case("render_exclude_local", ["render", "--exclude", "n1"], "--exclude n1", "no node to exclude"),
    cli_case("render_after_local", ["render", "--after", "12"], "--after", "runs locally"),
    cli_case(
        "sweep_after_local",
        ["sweep", "--after", "12:any", "--grid", "lr=1", "--", "afile", "{lr}"],
        "--after",
        "runs locally",
    ),
    cli_case("list_sweeps_state", ["list", "--sweeps", "--state", "FAILED"], "--state", "not sweeps"),
    cli_case("list_sweeps_since", ["list", "--sweeps", "--since", "2h"], "--since", "not sweeps"),
    cli_case(
        "profiles_env_is_a_file",
        ["profiles", "list"],
        "$ORCHESTRATOR_PROFILES=afile",
        "not a folder",
        env={"ORCHESTRATOR_PROFILES": "afile"},
    ),
    cli_case(
        "runs_env_empty",
        ["submit", "--", "afile"],
        "$ORCHESTRATOR_RUNS is set but empty",
        env={"ORCHESTRATOR_RUNS": ""},
    ),
    cli_case(
        "home_env_empty", ["list"], "$ORCHESTRATOR_HOME is set but empty", env={"ORCHESTRATOR_HOME": ""}
    ),
    cli_case(
        "home_env_empty_status",
        ["status"],
        "$ORCHESTRATOR_HOME is set but empty",
        env={"ORCHESTRATOR_HOME": " "},
    ),
    # every command and the newer flags, on the local profile
    cli_case(
        "hang_timeout_zero", ["submit", "--hang-timeout", "0", "--", "afile"], "--hang-timeout", "1 to 86400"
    ),
    cli_case(
        "hang_timeout_over_a_day",
        ["render", "--hang-timeout", "99999"],
        "--hang-timeout",
        "1 to 86400",
    ),
    cli_case("hang_timeout_word", ["submit", "--hang-timeout", "soon", "--", "afile"], "--hang-timeout"),
    cli_case(
        "submit_script_missing", ["submit", "--", "nowhere.py"], "training script not found: nowhere.py"
    ),
    cli_case(
        "submit_max_requeues_negative", ["submit", "--max-requeues", "-1", "--", "afile"], "--max-requeues"
    ),
    cli_case("wait_unknown_job", ["wait", "local-99"], "unknown job id 'local-99'"),
    cli_case("wait_timeout_negative", ["wait", "local-1", "--timeout", "-1"], "--timeout", "> 0"),
    cli_case("stacks_unknown_job", ["stacks", "local-99"], "unknown job id 'local-99'"),
    cli_case("stacks_json_unknown_job", ["stacks", "local-99", "--json"], "unknown job id 'local-99'"),
    cli_case("status_unknown_job", ["status", "local-99"], "unknown job id 'local-99'"),
    cli_case("status_sweep_bad_metric", ["status", "9999", "--metric", "accuracy"], "--metric", "'accuracy'"),
    cli_case("status_interval_zero", ["status", "--interval", "0"], "--interval"),
    cli_case("resume_unknown_job", ["resume", "local-99"], "unknown job id 'local-99'"),
    cli_case("resume_sweep_failed_unknown", ["resume", "9999", "--failed"], "unknown sweep id '9999'"),
    cli_case("resume_nodes_zero", ["resume", "local-1", "--nodes", "0"], "--nodes", "'0'"),
    cli_case(
        "resume_strategy_typo", ["resume", "local-1", "--strategy", "fulshard"], "--strategy", "'full_shard'"
    ),
    cli_case("logs_unknown_job", ["logs", "local-99"], "unknown job id 'local-99'"),
    cli_case("logs_tail_negative", ["logs", "local-1", "--tail", "-1"], "--tail -1"),
    cli_case("cancel_unknown_job", ["cancel", "local-99"], "unknown job id 'local-99'"),
    cli_case("cancel_signal_zero", ["cancel", "local-1", "--signal", "0"], "--signal '0'"),
    cli_case("cancel_signal_unknown", ["cancel", "local-1", "--signal", "FOO"], "--signal 'FOO'"),
    cli_case("plot_unknown_job", ["plot", "local-99"], "unknown job id 'local-99'"),
    cli_case("list_state_unknown", ["list", "--state", "BOGUS"], "--state", "'BOGUS'"),
    cli_case("list_since_words", ["list", "--since", "yesterday"], "--since 'yesterday'"),
    cli_case("sweep_file_not_a_grid", ["sweep", "--file", "afile", "--", "afile"], "--file afile", "grid"),
    cli_case(
        "show_unknown_profile",
        ["profiles", "show", "locl"],
        "unknown profile 'locl'",
        "(did you mean 'local'?)",
    ),
]


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def _cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["ORCHESTRATOR_HOME"] = str(home / "orchestrator_home")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run_case(case: Case, root: Path) -> Result:
    folder = root / case.id
    profiles = folder / "cluster_profiles"
    profiles.mkdir(parents=True)
    if case.profile is not None:
        target = profiles / f"{case.id}.yaml"
        if isinstance(case.profile, bytes):
            target.write_bytes(case.profile)
        else:
            target.write_text(case.profile, encoding="utf-8")
    (folder / "afile").write_text("not a folder\n")
    for name, content in case.extra_files.items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *case.args],
        cwd=folder,
        env={**_cli_env(folder), **case.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Result]]:
    with tempfile.TemporaryDirectory(prefix="bad_input_") as tmp, ThreadPoolExecutor(max_workers=6) as pool:
        futures = {case.id: pool.submit(_run_case, case, Path(tmp)) for case in CASES}
        yield {case_id: future.result() for case_id, future in futures.items()}


def test_enough_cases() -> None:
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def _error_line(case: Case, result: Result) -> str:
    """The one error line; argparse may print its usage block above it, nothing else may."""
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines, f"{case.id}: nothing on stderr"
    if lines[0].startswith("usage:"):  # argparse: usage block, then the error as the last line
        assert all(line.startswith(" ") for line in lines[1:-1]), result.stderr
        return lines[-1]
    assert len(lines) == 1, f"{case.id}: expected one line on stderr, got:\n{result.stderr}"
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, results: dict[str, Result]) -> None:
    result = results[case.id]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 2, (
        f"{case.id}: exit {result.returncode}\nstdout:{result.stdout}\nstderr:{result.stderr}"
    )
    line = _error_line(case, result)
    prefix = f"orchestrator {case.args[0]}: error: "
    assert line.startswith(prefix), line
    message = line[len(prefix) :]
    file = f"cluster_profiles/{case.id}.yaml"
    if case.exact is not None:
        assert message == case.exact
    for want in case.expect:
        assert want.replace("{file}", file) in message, f"{case.id}: {want!r} not in {message!r}"
    if case.profile is not None and case.names_file:
        assert file in message, f"{case.id}: error does not name {file}: {message!r}"
    # Nothing was rendered or written on the way to the error.
    if case.args[0] == "render":
        assert result.stdout == ""
