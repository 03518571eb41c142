"""The files a plan makes, by name, for ``render`` and ``submit --dry-run``: the scheduler's batch
script (for a SAMPLE run directory) and each node's Accelerate (and DeepSpeed) config."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config.plan import LaunchPlan
from orchestrator.config.render import (
    needs_deepspeed_config_file,
    render_accelerate_config,
    render_deepspeed_config,
    sample_runtime,
)
from orchestrator.contract.run_dir import node_config_file, node_deepspeed_config_file

SAMPLE_RUN_DIR = "/SAMPLE/run_dir"


def render_files(plan: LaunchPlan, node_rank: int | None, python: str) -> dict[str, str]:
    """File name -> text, in the order a reader wants them."""
    from orchestrator.schedulers import get_scheduler

    files: dict[str, str] = {}
    scheduler = get_scheduler(plan.profile.scheduler)
    if scheduler.writes_batch_script:
        request = scheduler.dryrun(plan, Path(SAMPLE_RUN_DIR), 0, python)
        shebang, _, body = request.materialize().partition("\n")
        files[request.file_name] = f"{shebang}\n# SAMPLE run directory: each job gets its own.\n{body}"
    ranks = range(plan.nodes) if node_rank is None else [node_rank]
    for rank in ranks:
        files[node_config_file(Path(), rank).name] = render_accelerate_config(
            plan, sample_runtime(plan, rank)
        )
        if needs_deepspeed_config_file(plan):
            files[node_deepspeed_config_file(Path(), rank).name] = render_deepspeed_config(plan)
    return files
