"""``orchestrator ui``: a local, read-only web dashboard of jobs, runs and sweeps.

It reads through the Python API only (``status``'s rows, ``sweep_status``, ``logs``, the run
curves), so a job reads the same in the browser as in ``status``. Its dependency (plotly, for the
charts' JavaScript) is the ``[ui]`` extra; nothing outside this package and ``cli/ui.py`` imports it.
"""
