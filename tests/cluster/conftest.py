"""The cluster folder's fixture: only its tests (all marked ``slurm`` by tests/conftest.py) can ask for
the real cluster."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The real test cluster started by tests/cluster/run_with_cluster.sh (skipped locally
    without it, a failure in CI: see tests/helpers/slurm_cluster.require_cluster)."""
    from tests.helpers.slurm_cluster import require_cluster

    require_cluster()
    return {
        k: v for k, v in os.environ.items() if k.startswith("ORCHESTRATOR_TEST_CLUSTER") or k == "SLURM_CONF"
    }
