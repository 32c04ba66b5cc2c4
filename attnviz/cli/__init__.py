"""The command line (Typer): parse, call a use case, render, map errors to exit codes."""

from attnviz.cli.main import app, main

__all__ = ["app", "main"]
