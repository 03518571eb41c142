"""The command line: argparse commands that parse flags, call :mod:`orchestrator.api` and print."""
