"""The ``fxopt`` command line: `main` (subcommands) and `report` (tables, DOT, timelines)."""

from fxopt.cli.main import main

__all__ = ["main"]
