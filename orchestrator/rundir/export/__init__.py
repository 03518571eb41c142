"""``orchestrator export``'s parts: which checkpoint (``find``), its tensors whatever wrote them
(``read``), the files written (``write``) and the proof (``verify``). The command itself, which
finds a job's run directory in the registry, is :mod:`orchestrator.runner.export`."""
