"""The input options of the commands that read a corpus (`attnviz corpus`, `attnviz compare`),
declared once: how the corpus is read, sampled and cut, and what is measured on it."""

from __future__ import annotations

from typing import Annotated

import typer

from attnviz.cli.options import choice_option, positive
from attnviz.core import choices

Field = Annotated[str | None, typer.Option("--field", help=(
    "JSON lines: the string field that holds each example's text."))]
Limit = Annotated[int | None, typer.Option("--limit", callback=positive, help=(
    "Only the first N examples (of the sample, with --sample)."))]
Sample = Annotated[int | None, typer.Option("--sample", callback=positive, help=(
    "N examples drawn uniformly from the corpus in one pass (reservoir sampling, --seed)."))]
Long = Annotated[choices.LongExamples, choice_option(choices.LongExamples, "--long", help=(
    "An example longer than --max-tokens: truncate it to its first --max-tokens tokens, or "
    "skip it (both counted)."))]
Weighting = Annotated[choices.Weighting, choice_option(choices.Weighting, "--weighting", help=(
    "attention: the weights α_ij; norm: the value-weighted maps ‖α_ij · W_O^h v_j‖, rows "
    "normalized."))]
MaxTokens = Annotated[int, typer.Option("--max-tokens", callback=positive, help=(
    "Longest example run, in the model's tokens (see --long)."))]
