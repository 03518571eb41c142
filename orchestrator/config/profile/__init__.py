"""Cluster profiles: the records and their documentation (``records``), the checks (``schema``, with
``messages`` for the words of an error and the ``*_keys`` blocks), loading (``load``) and the
generated reference (``reference``)."""

# Imported here so that the records can validate as soon as any of the package's modules is imported
# (the schema registers its ``validate`` with them; they do not import it: no cycle).
from orchestrator.config.profile import schema as _schema  # noqa: E402,F401
