"""Choices a command takes as one option, as `str` Enums: the CLI parses them (Typer lists the
values in --help and refuses others), and the request keeps their plain string value."""

from __future__ import annotations

from enum import Enum


class AblationMode(str, Enum):
    """What replaces a removed head's slice of the input to W_O (attnviz ablate --mode)."""

    ZERO = "zero"  # zeroed
    MEAN = "mean"  # its mean over the batch's real tokens
