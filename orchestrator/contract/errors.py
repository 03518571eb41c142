"""Error types that carry their exit code.

The CLI turns these into one line on stderr and the exit code below, so a user
mistake never shows a Python traceback. Anything else that escapes is a bug.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class: an expected failure with a message meant for the user."""

    exit_code: int = 1


class UserError(OrchestratorError):
    """Bad input: configuration, profile, strategy combination or CLI value (exit 2)."""

    exit_code = 2


class RunFailure(OrchestratorError):
    """The job or run failed at run time (exit 1)."""

    exit_code = 1


EXIT_OK = 0
EXIT_RUN_FAILURE = 1
EXIT_USAGE = 2
