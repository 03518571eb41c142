"""This orchestrator's version: a leaf every layer may read (the login host's agent compares it with
the laptop's; ``remote install`` pushes it), so that no one loads the package by name for it."""

__version__ = "0.1.0"
