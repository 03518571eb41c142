"""What every rendered batch script must say, derived from the plan and the profile alone.

Independent of the golden files: a template that loses the pre-timeout signal, ``--requeue``,
``--kill-on-bad-exit``, the supervisor or a set-up line fails here even after the goldens are
regenerated. Each script is parsed (``#SBATCH`` header, then the body's lines) and compared with
what the plan asks for; shell words are read back with ``shlex`` so quoting is checked too.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
import yaml

from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import parse_profile
from orchestrator.config.render import NODE_SETUP_VAR, PYTHON_VAR, render_sbatch
from orchestrator.contract.errors import UserError
from tests.helpers.golden import PYTHON, REPO, RUN_DIR, SUBMITIT, Combo, builtin_profiles, combos, plan_for


def _slurm_plans() -> dict[Combo, LaunchPlan]:
    plans = {}
    for combo in combos():
        if builtin_profiles()[combo.profile_name].scheduler != "slurm":
            continue
        try:
            plans[combo] = plan_for(combo)
        except UserError:
            continue  # refused combinations: tests/golden/refused.txt
    return plans


SLURM_PLANS = _slurm_plans()


def parse_script(script: str) -> tuple[list[tuple[str, str | None]], list[str]]:
    """``([(option, value or None)], body lines)``; the header is the leading comment block."""
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    header_end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    directives: list[tuple[str, str | None]] = []
    for line in lines[1:header_end]:
        if line.startswith("#SBATCH "):
            word = line[len("#SBATCH ") :]
            key, eq, value = word.partition("=")
            directives.append((key, shlex.split(value)[0] if eq else None))
    body = lines[header_end:]
    assert not any(line.startswith("#SBATCH") for line in body), (
        "an #SBATCH line after the first command is ignored"
    )
    return directives, body


def statements(lines: list[str]) -> list[str]:
    """The code lines (no blanks, no comments), a quoted string spanning lines joined into one."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending)
        except ValueError:  # "No closing quotation": the string goes on
            continue
        out.append(pending)
        pending = ""
    assert not pending, f"an unclosed quotation: {pending}"
    return out


def check_script(plan: LaunchPlan, script: str, attempt_base: int = 0) -> None:
    profile = plan.profile
    directives, body = parse_script(script)
    options = dict(directives)
    assert len(options) == len(directives), f"an option given twice: {directives}"
    # Allocation shape.
    assert options["--nodes"] == str(plan.nodes)
    assert options["--ntasks-per-node"] == "1"
    assert options["--cpus-per-task"] == str(profile.cpus_per_task)
    assert options["--partition"] == profile.partition
    assert options.get("--account") == profile.account
    assert options.get("--qos") == profile.qos
    assert options.get("--mem") == profile.mem
    assert options.get("--constraint") == profile.constraint
    if profile.gpus_per_node:
        gpu = f"gpu:{profile.gpu_type}:" if profile.gpu_type else "gpu:"
        assert options["--gres"] == f"{gpu}{profile.gpus_per_node}"
    else:
        assert "--gres" not in options
    assert ("--exclusive" in options) is profile.exclusive and options.get("--exclusive") is None
    assert options.get("--exclude") == (",".join(plan.exclude_nodes) or None)
    # Time limit, the pre-timeout signal and its lead time, requeue.
    assert options["--time"] == plan.time_limit
    assert options["--signal"] == f"{profile.signal.name}@{profile.signal.seconds_before}"
    assert "--requeue" in options and options["--requeue"] is None
    assert options["--open-mode"] == "append"
    assert (
        options["--output"] == f"{SUBMITIT}/%j_0_log.out" and options["--error"] == f"{SUBMITIT}/%j_0_log.err"
    )
    for key, value in profile.extra_sbatch.items():
        if value is True:
            assert f"--{key}" in options and options[f"--{key}"] is None
        elif value is False:
            assert f"--{key}" not in options
        else:
            assert options[f"--{key}"] == str(value)
    # The body, in order: set-up lines as written, the interpreter looked up after them, the
    # environment (quoted), with set-up lines what each node's task runs first (set-up lines and the
    # environment again), then the supervised step as the last command.
    code = statements(body)
    setup = list(profile.setup)
    assert code[: len(setup)] == setup
    rest = code[len(setup) :]
    resolve = f"{PYTHON_VAR}=$(command -v {shlex.quote(PYTHON)}) || "
    assert rest[0].startswith(resolve) and "exit 1" in rest[0]
    assert rest[1] == f"export {PYTHON_VAR}"
    node_setup: list[str] = []
    if setup:
        export, assignment = shlex.split(rest[-2])  # exported: the preflight's tasks run it too
        assert export == "export"
        name, _, node_script = assignment.partition("=")
        assert name == NODE_SETUP_VAR
        node_lines = statements(node_script.splitlines())
        assert node_lines[: len(setup)] == setup and node_lines[-1] == 'exec "$@"', node_lines
        profile_exports = rest[2 : 2 + len(profile.env)]
        assert node_lines[len(setup) : -1] == profile_exports, node_lines
        node_setup = ["bash", "-c", f"${NODE_SETUP_VAR}", "orchestrator-node-setup"]
        rest = rest[:-2] + rest[-1:]
    exports = [shlex.split(line) for line in rest[2:-1]]
    assert all(words[0] == "export" and len(words) == 2 for words in exports), rest
    expected_env = {k: ("1" if v else "0") if isinstance(v, bool) else str(v) for k, v in profile.env.items()}
    expected_env |= {"ORCHESTRATOR_RUN_DIR": RUN_DIR, "SUBMITIT_EXECUTOR": "slurm"}
    got_env = dict(words[1].split("=", 1) for words in exports)
    assert got_env == expected_env
    profile_keys = [words[1].split("=", 1)[0] for words in exports][: len(profile.env)]
    assert profile_keys == sorted(profile.env)
    step = shlex.split(rest[-1])
    supervisor = [
        "exec",
        f"${PYTHON_VAR}",
        "-m",
        "orchestrator.schedulers.slurm.batch_step",
        "--attempt-base",
        str(attempt_base),
    ]
    supervisor += ["--auto-resume"] if plan.auto_resume else []
    srun = [
        "srun",
        "--unbuffered",
        "--kill-on-bad-exit=1",
        "--output",
        f"{SUBMITIT}/%j_%t_log.out",
        "--error",
        f"{SUBMITIT}/%j_%t_log.err",
    ]
    task = [f"${PYTHON_VAR}", "-u", "-m", "submitit.core._submit", SUBMITIT]
    assert step == [*supervisor, "--", *srun, *node_setup, *task]


@pytest.mark.parametrize("combo", list(SLURM_PLANS), ids=[c.id for c in SLURM_PLANS])
def test_every_builtin_script_says_what_the_plan_asks(combo: Combo) -> None:
    plan = SLURM_PLANS[combo]
    check_script(plan, render_sbatch(plan, RUN_DIR, SUBMITIT, PYTHON))


def test_a_profile_using_every_key() -> None:
    """Set-up lines with quotes, hostile env values, extra options, exclusivity, auto-resume and an
    exclude list, at a later attempt: each reaches the script with its meaning intact."""
    data = yaml.safe_load((REPO / "cluster_profiles" / "slurm_a100.yaml").read_text())
    data.update(
        setup=["module load cuda", 'source "$HOME/venv\'s/bin/activate"', "echo 'a;b' && true"],
        env={"B_VAR": "x y", "A_VAR": "$(touch /tmp/no)", "C_FLAG": True, "D_NUM": 3},
        extra_sbatch={"reservation": "big one", "hint": "nomultithread", "requeue-me": True, "skip": False},
        exclusive=True,
        account="ml",
        qos="high",
        mem="480G",
        constraint="a100&ib",
        time_limit="2-00:00:00",
        signal={"name": "USR1", "seconds_before": 300},
    )
    profile = parse_profile(yaml.safe_dump(data), "every_key.yaml")
    plan = build_plan(
        "every_key",
        profile,
        merge_options(profile, strategy="hybrid_shard"),
        "train.py",
        nodes=2,
        auto_resume=True,
        exclude_nodes=("n3", "gpu[01-02]"),
    )
    check_script(plan, render_sbatch(plan, RUN_DIR, SUBMITIT, PYTHON, attempt_base=4), attempt_base=4)
    other = replace(plan, auto_resume=False, exclude_nodes=())
    check_script(other, render_sbatch(other, RUN_DIR, SUBMITIT, PYTHON))


@pytest.mark.parametrize(
    "mutation",
    [
        ("#SBATCH --requeue\n", ""),
        ("#SBATCH --signal=USR2@180\n", ""),
        ("--kill-on-bad-exit=1 ", ""),
        (" -m orchestrator.schedulers.slurm.batch_step --attempt-base 0 --", ""),
        ('source "$HOME/venvs/train/bin/activate"\n', ""),
        ("export NCCL_IB_HCA=mlx5\n", "export NCCL_IB_HCA=mlx4\n"),
        ("#SBATCH --time=2-00:00:00\n", "#SBATCH --time=01:00:00\n"),
        ('bash -c "$ORCHESTRATOR_NODE_SETUP" orchestrator-node-setup ', ""),
        ('\nmodule load cuda/12.4 nccl/2.21\nsource "$HOME/venvs/train/bin/activate"\nexport', "\nexport"),
    ],
    ids=[
        "requeue",
        "signal",
        "kill-on-bad-exit",
        "supervisor",
        "setup-line",
        "env-value",
        "time",
        "setup-not-on-nodes",
        "node-setup-lines",
    ],
)
def test_the_check_catches_a_script_that_lost_something(mutation: tuple[str, str]) -> None:
    """The checker itself can fail: each of these edits of a real script is caught."""
    plan = next(
        p for c, p in SLURM_PLANS.items() if c.profile_name == "slurm_a100" and c.strategy == "full_shard"
    )
    script = render_sbatch(plan, RUN_DIR, SUBMITIT, PYTHON)
    old, new = mutation
    assert old in script, old
    with pytest.raises((AssertionError, StopIteration, KeyError)):
        check_script(plan, script.replace(old, new, 1))
