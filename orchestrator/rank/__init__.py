"""Code that runs inside every training rank: the self-check and the Accelerate workarounds,
shared by ``train/`` and the node-side hooks for users' own scripts (``orchestrator/rank/site``)."""
