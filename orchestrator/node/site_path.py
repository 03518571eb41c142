"""Where the ranks' site hooks live (:mod:`orchestrator.rank.site`), as a path: the node side puts
that folder first on the ranks' ``PYTHONPATH`` and never imports it (it runs inside the ranks)."""

from __future__ import annotations

from pathlib import Path

#: Put first on the ranks' PYTHONPATH: the script hooks and DeepSpeed on CPU (see its sitecustomize).
NODE_SITE_DIR = str(Path(__file__).resolve().parents[1] / "rank" / "site")
