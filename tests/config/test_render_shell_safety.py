"""Profile and command-line strings reach the sbatch script as data, never as code.

A profile whose env values, account, qos, constraint, GPU type and extra sbatch
options (everything but ``setup``, which is shell code by design) carry command
substitutions, backticks, ``;`` and quotes is rendered through the real CLI. Then:

* the script passes ``bash -n``;
* its export section is executed by bash in a sandbox (HOME/TMPDIR under tmp_path):
  no marker file appears and every variable holds the literal string;
* every ``#SBATCH`` value, read as shell words, is one word equal to the literal;
* the whole script runs under bash with ``srun`` stubbed: same result, and the srun
  arguments are the literal paths;
* newlines in fields that become ``#SBATCH`` options are refused with exit 2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.plan import build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.render import render_accelerate_config, render_sbatch, sample_runtime
from tests.helpers.cli import REPO

BASH = shutil.which("bash")


SUPERVISOR_RE = re.compile(
    r"^exec (.*) -m orchestrator\.schedulers\.slurm\.batch_step --attempt-base \d+( --auto-resume)? -- (?=srun )",
    re.M,
)


def strip_supervisor(script: str) -> str:
    """The step runs as ``exec "$ORCHESTRATOR_PYTHON" -m orchestrator.schedulers.slurm.batch_step ... -- srun ...``; a
    bash function cannot stand in for an interpreter path, so drop the prefix (checked to be the one
    quoted variable the script resolved after its set-up lines) and let the stubbed ``srun`` run in
    the script itself."""
    matches = SUPERVISOR_RE.findall(script)
    assert len(matches) == 1, script
    assert matches[0][0] == '"$ORCHESTRATOR_PYTHON"', matches
    return SUPERVISOR_RE.sub("", script)


def hostile(marker: Path) -> list[str]:
    """Strings that run `touch <marker>` if anything ever evaluates them."""
    m = str(marker)
    return [
        f"$(touch {m})",
        f"`touch {m}`",
        f"x; touch {m}",
        f"x' ; touch {m} ; echo '",
        f'x" ; touch {m} ; echo "',
        f"\"$(touch {m})\" '`touch {m}`' && touch {m} | touch {m} # hash",
        f"${{IFS}}touch${{IFS}}{m}",
    ]


def evil_profile(marker: Path) -> dict[str, object]:
    h = hostile(marker)
    env = {f"EVIL_{i}": value for i, value in enumerate(h)}
    env["EVIL_NEWLINE"] = f"line one\n$(touch {marker})\nline three"
    env["EVIL_BACKSLASH"] = "back\\slash \\$(touch x) \\n"
    env["EVIL_DOLLAR_HOME"] = "$HOME ${HOME} ~"
    env["PLAIN_INT"] = 8
    env["PLAIN_BOOL"] = True
    return {
        "description": h[0],
        "scheduler": "slurm",
        "partition": h[2],
        "account": h[0],
        "qos": h[1],
        "constraint": h[3],
        "gpus_per_node": 1,
        "gpu_type": h[4],
        "extra_sbatch": {
            "comment": h[5],
            "reservation": h[6],
            "mail-type": "END,FAIL",
            "hint": True,
            "x11": False,
        },
        "env": env,
        "setup": ["true"],  # shell code by design: present, unquoted, harmless here
    }


JOB_NAME_TAIL = "`touch {m}`;'\"$(touch {m})"


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, object]:
    """Render the hostile profile's sbatch through the real CLI into tmp_path/out."""
    marker = tmp_path / "marker_file"
    work = tmp_path / "work"
    (work / "cluster_profiles").mkdir(parents=True)
    profile = evil_profile(marker)
    (work / "cluster_profiles" / "evil.yaml").write_text(yaml.safe_dump(profile), encoding="utf-8")
    job_name = "job " + JOB_NAME_TAIL.format(m=marker)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "render",
            "--profile",
            "evil",
            "--name",
            job_name,
            "--out",
            "out",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    return {
        "marker": marker,
        "profile": profile,
        "job_name": job_name,
        "script": (work / "out" / "sbatch.sh").read_text(),
        "tmp": tmp_path,
    }


def sandbox_env(tmp: Path) -> dict[str, str]:
    home = tmp / "home"
    scratch = tmp / "scratch"
    home.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(scratch),
        "LC_ALL": "C",
    }


def run_bash(script: str, tmp: Path, **extra_env: str) -> subprocess.CompletedProcess[bytes]:
    path = tmp / f"snippet_{abs(hash(script))}.sh"
    path.write_text(script)
    assert BASH is not None
    return subprocess.run(
        [BASH, str(path)],
        cwd=tmp / "scratch",
        env={**sandbox_env(tmp), **extra_env},
        capture_output=True,
        timeout=30,
    )


def dump_vars(names: list[str]) -> str:
    """Bash that prints NAME=VALUE pairs NUL-separated (values may hold newlines)."""
    return "".join(f'printf "%s=%s\\0" {name} "${{{name}}}"\n' for name in names)


def parse_dump(data: bytes) -> dict[str, str]:
    pairs = [item.decode() for item in data.split(b"\0") if item]
    return dict(pair.split("=", 1) for pair in pairs)


def expected_env(profile: dict[str, object]) -> dict[str, str]:
    env = profile["env"]
    assert isinstance(env, dict)
    return {k: ("1" if v is True else "0" if v is False else str(v)) for k, v in env.items()}


def export_section(script: str) -> str:
    start = script.index("# Environment from the profile")
    end = script.index("\n# --kill-on-bad-exit")
    return script[start:end] + "\n"


# ------------------------------------------------------------------------------------------


def test_bash_syntax(sandbox: dict[str, object]) -> None:
    script = sandbox["script"]
    assert isinstance(script, str)
    path = Path(str(sandbox["tmp"])) / "sbatch.sh"
    path.write_text(script)
    assert BASH is not None
    result = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_export_section_holds_literals(sandbox: dict[str, object]) -> None:
    tmp, marker, script = Path(str(sandbox["tmp"])), Path(str(sandbox["marker"])), str(sandbox["script"])
    want = expected_env(sandbox["profile"])  # type: ignore[arg-type]
    section = export_section(script)
    assert section.count("export ") >= len(want)
    sandbox_env(tmp)
    result = run_bash("set -u\n" + section + dump_vars(sorted(want)), tmp)
    assert result.returncode == 0, result.stderr.decode()
    assert not marker.exists(), "a profile env value was executed"
    assert parse_dump(result.stdout) == want
    # The variables are exported (visible to child processes), not just set.
    child = run_bash(section + "env -0\n", tmp)
    exported = parse_dump(child.stdout)
    assert {k: exported[k] for k in want} == want
    assert exported["ORCHESTRATOR_RUN_DIR"] == "/SAMPLE/run_dir"
    assert not marker.exists()


def sbatch_directives(script: str) -> list[tuple[str, str | None]]:
    """(option, raw value text) for every #SBATCH line, in order."""
    out = []
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            option = line[len("#SBATCH ") :]
            key, sep, value = option.partition("=")
            out.append((key, value if sep else None))
    return out


def test_sbatch_header_is_contiguous(sandbox: dict[str, object]) -> None:
    """sbatch stops reading #SBATCH lines at the first command: none may come after one."""
    lines = str(sandbox["script"]).splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])
    assert sum(line.startswith("#SBATCH") for line in lines[:first_command]) >= 15


def test_sbatch_values_are_single_literal_words(sandbox: dict[str, object]) -> None:
    tmp, marker, script = Path(str(sandbox["tmp"])), Path(str(sandbox["marker"])), str(sandbox["script"])
    profile = sandbox["profile"]
    assert isinstance(profile, dict)
    extra = profile["extra_sbatch"]
    expected = {
        "--job-name": sandbox["job_name"],
        "--partition": profile["partition"],
        "--account": profile["account"],
        "--qos": profile["qos"],
        "--constraint": profile["constraint"],
        "--gres": f"gpu:{profile['gpu_type']}:1",
        "--comment": extra["comment"],
        "--reservation": extra["reservation"],
        "--mail-type": "END,FAIL",
    }
    directives = dict(sbatch_directives(script))
    assert directives["--hint"] is None and "--x11" not in directives
    checks = []
    for key, raw in directives.items():
        if raw is None:
            continue
        # Each value, as shell words, must be exactly one word.
        checks.append(f"set -- {raw}\n" + f'printf "%s=%s\\0" {key[2:].replace("-", "_")} "$#:$1"\n')
    script_text = "".join(checks)
    sandbox_env(tmp)
    syntax = subprocess.run([str(BASH), "-n"], input=script_text.encode(), capture_output=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr.decode()
    result = run_bash("set -f\n" + script_text, tmp)
    assert result.returncode == 0, result.stderr.decode()
    assert not marker.exists(), "an #SBATCH value was executed"
    got = parse_dump(result.stdout)
    for key, value in expected.items():
        assert got[key[2:].replace("-", "_")] == f"1:{value}", key


def test_whole_script_with_srun_stub(sandbox: dict[str, object]) -> None:
    """Run the entire rendered script (setup, exports, srun line) with srun replaced by a stub."""
    tmp, marker, script = Path(str(sandbox["tmp"])), Path(str(sandbox["marker"])), str(sandbox["script"])
    want = expected_env(sandbox["profile"])  # type: ignore[arg-type]
    sandbox_env(tmp)
    stub = tmp / "stub.sh"
    args_file, env_file, node_env_file = tmp / "srun_args", tmp / "srun_env", tmp / "node_env"
    # The stub also runs what each node's task runs first (set-up lines and environment, then
    # ``exec "$@"``), with ``env -0`` standing in for the node entry.
    stub.write_text(
        f'srun() {{ printf "%s\\0" "$@" > {args_file}; env -0 > {env_file}; shift 6; '
        f'"$1" "$2" "$3" "$4" env -0 > {node_env_file}; }}\n'
        "python3() { echo 'python3 must not run' >&2; exit 99; }\n"
    )
    path = tmp / "sbatch.sh"
    path.write_text(strip_supervisor(script))
    result = subprocess.run(
        [str(BASH), str(path)],
        cwd=tmp / "scratch",
        env={**sandbox_env(tmp), "BASH_ENV": str(stub)},
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert not marker.exists()
    env = parse_dump(env_file.read_bytes())
    assert {k: env[k] for k in want} == want
    node_env = parse_dump(node_env_file.read_bytes())
    assert {k: node_env[k] for k in want} == want
    args = [a.decode() for a in args_file.read_bytes().split(b"\0") if a]
    folder = "/SAMPLE/run_dir/submitit"
    assert args[:6] == [
        "--unbuffered",
        "--kill-on-bad-exit=1",
        "--output",
        f"{folder}/%j_%t_log.out",
        "--error",
        f"{folder}/%j_%t_log.err",
    ]
    assert args[6] == "bash" and args[7] == "-c" and args[9] == "orchestrator-node-setup", args
    assert args[10:] == [sys.executable, "-u", "-m", "submitit.core._submit", folder]


def test_hostile_run_dir_and_python_via_api(tmp_path: Path) -> None:
    """run_dir, submitit folder and python path with spaces, quotes and $( ) stay literal."""
    marker = tmp_path / "marker_file"
    profile = parse_profile(yaml.safe_dump(evil_profile(marker)), "evil.yaml")
    plan = build_plan("evil", profile, merge_options(profile, strategy="ddp"), "train.py", nodes=1)
    run_dir = f'/runs/it\'s a "dir" $(touch {marker})'
    folder = f"{run_dir}/submit `touch {marker}`"
    # A real interpreter at a hostile path: the script looks it up (`command -v`) and must pass it on as
    # one literal word.
    interpreter = tmp_path / "py thon" / f"$(touch {marker})" / "python3"
    interpreter.parent.mkdir(parents=True)
    interpreter.symlink_to(sys.executable)
    python = str(interpreter)
    script = strip_supervisor(render_sbatch(plan, run_dir, folder, python))
    sandbox_env(tmp_path)
    stub = tmp_path / "stub.sh"
    args_file = tmp_path / "srun_args"
    stub.write_text(f'srun() {{ printf "%s\\0" "$@" > {args_file}; }}\n')
    result = run_bash(script + dump_vars(["ORCHESTRATOR_RUN_DIR"]), tmp_path, BASH_ENV=str(stub))
    assert result.returncode == 0, result.stderr.decode()
    assert not marker.exists()
    assert parse_dump(result.stdout)["ORCHESTRATOR_RUN_DIR"] == run_dir
    args = [a.decode() for a in args_file.read_bytes().split(b"\0") if a]
    assert args[3] == f"{folder}/%j_%t_log.out"
    assert args[10:] == [python, "-u", "-m", "submitit.core._submit", folder]
    directives = dict(sbatch_directives(script))
    check = run_bash(f"set -f\nset -- {directives['--output']}\nprintf '%s' \"$#:$1\"\n", tmp_path)
    assert check.stdout.decode() == f"1:{folder}/%j_0_log.out"
    assert not marker.exists()


def test_accelerate_config_values_are_yaml_data(tmp_path: Path) -> None:
    """A hostile --wrap-cls cannot add keys to the Accelerate config."""
    profile = parse_profile("scheduler: local\nprocs_per_node: 2\n", "p.yaml")
    wrap = "Block\"\nmachine_rank: 7\n# ': {x}"
    plan = build_plan("p", profile, merge_options(profile, strategy="full_shard", wrap_cls=wrap), "t.py")
    config = yaml.safe_load(render_accelerate_config(plan, sample_runtime(plan)))
    assert config["machine_rank"] == 0
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == wrap


# ------------------------------------------------------------------------------------------
# Newlines in fields that become #SBATCH options are refused (exit 2), never rendered.

NEWLINE_CASES = [
    pytest.param({"account": "a\nb"}, [], "account", id="account"),
    pytest.param({"partition": "gpu\n#SBATCH --x"}, [], "partition", id="partition"),
    pytest.param({"qos": "q\r"}, [], "qos", id="qos-cr"),
    pytest.param({"constraint": "c\n"}, [], "constraint", id="constraint-trailing"),
    pytest.param({"gpu_type": "a100\nx", "gpus_per_node": 1}, [], "gpu_type", id="gpu_type"),
    pytest.param({"time_limit": "01:00:00\n"}, [], "time_limit", id="time_limit"),
    pytest.param({"mem": "4G\n"}, [], "mem", id="mem-trailing"),
    pytest.param({"extra_sbatch": {"comment": "a\nb"}}, [], "extra_sbatch", id="extra_sbatch-value"),
    pytest.param({"extra_sbatch": {"comment\n": "a"}}, [], "extra_sbatch", id="extra_sbatch-key"),
    pytest.param({"env": {"A\n": "x"}}, [], "env", id="env-name"),
    pytest.param({}, ["--name", "job\n#SBATCH --account=other"], "--name", id="cli-name"),
    pytest.param({}, ["--name", "job\r"], "--name", id="cli-name-cr"),
    pytest.param({}, ["--time", "90\n"], "--time", id="cli-time"),
]


@pytest.mark.parametrize(("fields", "cli", "key"), NEWLINE_CASES)
def test_newlines_in_sbatch_fields_refused(
    fields: dict[str, object], cli: list[str], key: str, tmp_path: Path
) -> None:
    (tmp_path / "cluster_profiles").mkdir()
    profile = {"scheduler": "slurm", "partition": "gpu", **fields}
    (tmp_path / "cluster_profiles" / "nl.yaml").write_text(yaml.safe_dump(profile), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "render", "--profile", "nl", *cli],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.search(rf"(cluster_profiles/nl\.yaml: )?{re.escape(key)}\b", lines[0]), lines[0]
    if not cli:
        assert "cluster_profiles/nl.yaml: " in lines[0]
