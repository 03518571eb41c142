"""Notifications: the events a run directory implies and their once-only claim (``events``), sending
them to a webhook or a command (``send``), and the login host's side that sends what the batch step
did not (``login``). The batch step's side is :mod:`orchestrator.schedulers.slurm.step_notify`."""
