"""The golden-file matrix: every built-in profile x strategy x FSDP version x node count, rendered
with fixed inputs (python ``python3``, run dir ``/RUN``, submitit folder ``/RUN/submitit``, the
sample runtime values), so the text is stable."""

from __future__ import annotations

import os
from dataclasses import dataclass

from orchestrator.config.plan import LaunchPlan, build_plan, merge_options
from orchestrator.config.profile.load import ClusterProfile, parse_profile
from orchestrator.config.render import (
    needs_deepspeed_config_file,
    render_accelerate_config,
    render_deepspeed_config,
    render_sbatch,
    sample_runtime,
)
from orchestrator.config.strategies import STRATEGIES
from tests.helpers.cli import REPO

GOLDEN = REPO / "tests" / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
PYTHON = "python3"
RUN_DIR = "/RUN"
SUBMITIT = "/RUN/submitit"


def builtin_profiles() -> dict[str, ClusterProfile]:
    # Read the shipped files directly: a ./cluster_profiles in the working directory
    # must not change what the goldens describe.
    return {
        p.stem: parse_profile(p.read_text(encoding="utf-8"), f"cluster_profiles/{p.name}")
        for p in sorted((REPO / "cluster_profiles").glob("*.yaml"))
    }


@dataclass(frozen=True)
class Combo:
    profile_name: str
    strategy: str
    fsdp_version: int
    nodes: int
    gradient_clipping: float | None = None
    """DeepSpeed only; None: the default."""

    @property
    def label(self) -> str:
        fsdp = "" if not STRATEGIES[self.strategy].uses_fsdp else f"-fsdp{self.fsdp_version}"
        clip = "" if self.gradient_clipping is None else f"-clip{self.gradient_clipping:g}"
        return f"{self.strategy}{fsdp}{clip}-{self.nodes}n"

    @property
    def id(self) -> str:
        return f"{self.profile_name}/{self.label}"


def combos() -> list[Combo]:
    out = []
    for name, profile in builtin_profiles().items():
        node_counts = [profile.nodes.default]
        if profile.nodes.default < 2 <= profile.nodes.max:
            node_counts.append(2)  # so hybrid strategies get a valid run on every multi-node profile
        for nodes in node_counts:
            for strategy in STRATEGIES:
                uses_fsdp = STRATEGIES[strategy].uses_fsdp
                versions = [1, 2] if uses_fsdp else [profile.defaults.fsdp_version]
                for version in versions:
                    out.append(Combo(name, strategy, version, nodes))
        # Clipping off: the DeepSpeed JSON the yaml names, and no mixed_precision in the yaml.
        out.append(Combo(name, "deepspeed_zero3", profile.defaults.fsdp_version, node_counts[-1], 0.0))
    return out


def plan_for(combo: Combo) -> LaunchPlan:
    profile = builtin_profiles()[combo.profile_name]
    extra = {} if combo.gradient_clipping is None else {"gradient_clipping": combo.gradient_clipping}
    options = merge_options(profile, strategy=combo.strategy, fsdp_version=combo.fsdp_version, **extra)
    return build_plan(
        combo.profile_name, profile, options, "train/train.py", ["--epochs", "1"], nodes=combo.nodes
    )


def render_combo(plan: LaunchPlan) -> str:
    parts = []
    if plan.profile.scheduler == "slurm":
        sbatch = render_sbatch(plan, RUN_DIR, SUBMITIT, PYTHON)
        parts.append(f"==> sbatch.sh <==\n{sbatch}")
    for rank in range(plan.nodes):
        config = render_accelerate_config(plan, sample_runtime(plan, rank))
        parts.append(f"==> accelerate_config.node{rank}.yaml <==\n{config}")
        if needs_deepspeed_config_file(plan):
            parts.append(f"==> deepspeed_config.node{rank}.json <==\n{render_deepspeed_config(plan)}")
    return "\n".join(parts)


def split_sections(text: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        if line.startswith("==> ") and line.rstrip().endswith(" <=="):
            name = line.strip()[4:-4]
            sections[name] = ""
        elif name is not None:
            sections[name] += line
    return sections
