"""Rendering: a plan in, text out (the sbatch script and each node's Accelerate config).

Jinja2 with StrictUndefined, so a missing value is an error rather than an empty
string in a shell line. jinja2 is imported on first render, not with this module, and compiled
templates are kept in Jinja's own per-user bytecode cache: compiling the two templates cost
``orchestrator render`` about as much as everything else it does. Every value that reaches a shell line goes through
``shq`` (shlex.quote); YAML values go through ``yaml`` (a JSON-style quoted
scalar), so a profile cannot inject code or keys.
"""

from __future__ import annotations

import json
import shlex
import zlib
from dataclasses import dataclass
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config import container
from orchestrator.config.plan import LaunchPlan
from orchestrator.config.scheduler_kinds import scheduler_kind
from orchestrator.contract.errors import UserError

if TYPE_CHECKING:
    import jinja2

    from orchestrator.config.profile.load import ClusterProfile

#: Size-based auto-wrap threshold when no layer class is named (Accelerate's default is 1e8).
#: Blocks smaller than this are not units of their own: the train/ tiny preset (0.2M per block)
#: then has only Accelerate's root/tail units, so name the block with --wrap-cls for real sharding.
DEFAULT_MIN_NUM_PARAMS = 1_000_000

SAMPLE_JOB_ID = "12345"
#: The shell variable the batch script resolves the node-side interpreter into (profile key ``python``).
PYTHON_VAR = "ORCHESTRATOR_PYTHON"
#: The batch script's variable holding what each node's task runs before its node entry: the profile's
#: set-up lines and environment (``bash -c "$ORCHESTRATOR_NODE_SETUP" ...`` on the step's launch line).
NODE_SETUP_VAR = "ORCHESTRATOR_NODE_SETUP"


def templates_dir() -> Path:
    spec = find_spec("orchestrator.job_templates")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "job_templates"


def shell_quote(value: Any) -> str:
    """Quote any value for a POSIX shell; bools become 1/0 (what env-style flags expect)."""
    if isinstance(value, bool):
        value = "1" if value else "0"
    return shlex.quote(str(value))


def yaml_scalar(value: Any) -> str:
    """A YAML scalar that reads back as exactly this value (JSON is valid YAML)."""
    return json.dumps(value)


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """Jinja's per-user cache of compiled templates (a private 0700 folder it checks itself, keyed
    by template name and source checksum, so an edited template is recompiled); None where no
    such folder can be had: rendering then just compiles, as before."""
    import jinja2

    try:
        return jinja2.FileSystemBytecodeCache()
    except (OSError, RuntimeError):
        return None


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        bytecode_cache=_bytecode_cache(),
    )
    env.filters["shq"] = shell_quote
    env.filters["yaml"] = yaml_scalar
    return env


def port_for_job(job_id: str, start: int, end: int) -> int:
    """A port inside [start, end] that depends only on the job id.

    Two jobs sharing a node get different ports unless their ids collide modulo the
    range size; Slurm ids are consecutive, so that takes range-size jobs at once.
    """
    span = end - start + 1
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return start + number % span


@dataclass(frozen=True)
class NodeRuntime:
    """Values that exist only on the node, at run time."""

    machine_rank: int
    main_process_ip: str
    main_process_port: int
    sample: bool = False


def sample_runtime(plan: LaunchPlan, machine_rank: int = 0) -> NodeRuntime:
    start, end = plan.profile.port_range.start, plan.profile.port_range.end
    ip = scheduler_kind(plan.profile.scheduler).render_main_ip
    return NodeRuntime(machine_rank, ip, port_for_job(SAMPLE_JOB_ID, start, end), sample=True)


def rdzv_backend_for(plan: LaunchPlan) -> str:
    return scheduler_kind(plan.profile.scheduler).rdzv_backend or plan.profile.rdzv_backend


def needs_deepspeed_config_file(plan: LaunchPlan) -> bool:
    """DeepSpeed with clipping off: Accelerate drops ``gradient_clipping: 0.0`` from its yaml and DeepSpeed
    then clips at 1.0, so only a ``deepspeed_config_file`` can say 0."""
    return plan.strategy.uses_deepspeed and plan.options.gradient_clipping == 0


def render_deepspeed_config(plan: LaunchPlan) -> str:
    """The DeepSpeed JSON a node's yaml names when :func:`needs_deepspeed_config_file`. ``auto`` values
    are filled in by Accelerate (batch sizes from the prepared data loader). Mixed precision lives here
    then, and the yaml carries none (Accelerate refuses both)."""
    options = plan.options
    stage = plan.strategy.deepspeed_stage
    zero: dict[str, object] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu" if options.offload_optimizer else "none"},
        "offload_param": {"device": "cpu" if options.offload_params else "none"},
    }
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = options.zero3_save_16bit_model
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(options.gradient_clipping),
        "zero_optimization": zero,
        "fp16": {"enabled": options.mixed_precision == "fp16"},
        "bf16": {"enabled": options.mixed_precision == "bf16"},
    }
    return json.dumps(config, indent=2) + "\n"


def render_accelerate_config(
    plan: LaunchPlan, runtime: NodeRuntime, deepspeed_config_file: str | None = None
) -> str:
    """``deepspeed_config_file``: where this node's :func:`render_deepspeed_config` lies, when one is
    needed (a sample name next to the yaml when not given)."""
    if not 0 <= runtime.machine_rank < plan.nodes:
        raise UserError(f"--node-rank: expected 0..{plan.nodes - 1}, got {runtime.machine_rank}")
    if needs_deepspeed_config_file(plan) and deepspeed_config_file is None:
        from orchestrator.contract.run_dir import node_deepspeed_config_file

        deepspeed_config_file = node_deepspeed_config_file(Path(), runtime.machine_rank).name
    template = _environment().get_template("accelerate_config.yaml.j2")
    return template.render(
        deepspeed_config_file=deepspeed_config_file if needs_deepspeed_config_file(plan) else None,
        profile_name=plan.profile_name,
        strategy=plan.strategy,
        options=plan.options,
        node_label=f"{runtime.machine_rank} of {plan.nodes}",
        sample=runtime.sample,
        cpu=plan.uses_cpu,
        machine_rank=runtime.machine_rank,
        main_process_ip=runtime.main_process_ip,
        main_process_port=runtime.main_process_port,
        nodes=plan.nodes,
        procs_per_node=plan.procs_per_node,
        world_size=plan.world_size,
        rdzv_backend=rdzv_backend_for(plan),
        min_num_params=DEFAULT_MIN_NUM_PARAMS,
    )


def gres_for(plan: LaunchPlan) -> str:
    return profile_gres(plan.profile)


def profile_gres(profile: ClusterProfile) -> str:
    """The ``--gres`` value of a profile's GPUs (``gpu:TYPE:N``, or ``gpu:N`` without a type)."""
    gpu = profile.gpu_type
    return f"gpu:{gpu}:{profile.gpus_per_node}" if gpu else f"gpu:{profile.gpus_per_node}"


def render_sbatch(
    plan: LaunchPlan,
    run_dir: str,
    submitit_folder: str,
    python: str,
    attempt_base: int = 0,
    array: str | None = None,
) -> str:
    """The batch script. ``python`` (the profile's ``python`` key, or the submitting interpreter) is
    looked up on the batch host after the profile's set-up lines, and runs both the supervisor and
    submitit's per-task entry point on every node.

    ``array`` (a sweep): Slurm's ``--array`` value; ``run_dir`` is then the sweep's directory and each
    task runs in ``task_<i>`` under it, with its logs in that task's own submitit folder."""
    from orchestrator.contract.run_dir import ARRAY_TASK_FILE, SUBMITIT_DIR

    template = _environment().get_template("sbatch.sh.j2")
    folder = submitit_folder.rstrip("/")
    task_folder = f'"$ORCHESTRATOR_RUN_DIR"/{SUBMITIT_DIR}'
    if array is not None:
        folder = f"{run_dir.rstrip('/')}/task_%a/{SUBMITIT_DIR}"
    job = "%A_%a" if array is not None else "%j"
    return template.render(
        profile_name=plan.profile_name,
        profile=plan.profile,
        strategy=plan.strategy,
        nodes=plan.nodes,
        procs_per_node=plan.procs_per_node,
        world_size=plan.world_size,
        job_name=plan.job_name,
        time_limit=plan.time_limit,
        gres=gres_for(plan),
        run_dir=run_dir,
        stdout=f"{folder}/{job}_0_log.out",
        stderr=f"{folder}/{job}_0_log.err",
        # Already shell words: an array task's folder is known only at run time.
        task_stdout=f"{task_folder}/%A_%a_%t_log.out" if array else shlex.quote(f"{folder}/%j_%t_log.out"),
        task_stderr=f"{task_folder}/%A_%a_%t_log.err" if array else shlex.quote(f"{folder}/%j_%t_log.err"),
        command=node_command(plan, run_dir, task_folder if array else shlex.quote(folder)),
        container_step_flags=container.step_flags(plan, run_dir),
        array=array,
        submitit_dir=SUBMITIT_DIR,
        array_task_file=ARRAY_TASK_FILE,
        python_var=PYTHON_VAR,
        node_setup_var=NODE_SETUP_VAR,
        auto_resume=plan.auto_resume,
        hang_timeout=plan.hang_timeout,
        exclude_nodes=",".join(plan.exclude_nodes),
        dependency=",".join(plan.after),
        python=python,
        attempt_base=attempt_base,
    )


def node_command(plan: LaunchPlan, run_dir: str, folder_word: str) -> str:
    """What each node's task runs: submitit's entry point with the node-side interpreter, or inside the
    profile's container image (``orchestrator.config.container``). ``folder_word`` is a shell word."""
    if not container.enabled(plan):
        return f'"${PYTHON_VAR}" -u -m submitit.core._submit {folder_word}'
    return container.wrap_command(plan, run_dir, container.inner_command(plan, folder_word))


def accelerate_launch_command(
    config_path: str, script: str, script_args: list[str], log_dir: str | None = None
) -> list[str]:
    """argv that runs the training script on one node; ``log_dir``: torchrun's per-rank logs."""
    logs = ["--log_dir", log_dir, "--tee", "3"] if log_dir else []
    return ["accelerate", "launch", *logs, "--config_file", config_path, script, *script_args]
