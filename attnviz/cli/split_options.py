"""The options only `attnviz split` takes, declared as Annotated aliases like the shared ones in
`attnviz.cli.options`, so that the command's signature stays a list of names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.options import path_arg

WeightsOption = Annotated[Path | None, typer.Option("--weights", "-w", callback=path_arg, help=(
    "A checkpoint (.safetensors, .pt/.pth/.bin, or a model folder) instead of random init."))]
LayerOption = Annotated[str | None, typer.Option("--layer", "-l", help=(
    "Which attention layer: an index from 'attnviz inspect' or its name (--model: the "
    "model's own layer index)."))]
BiasOption = Annotated[bool, typer.Option("--bias/--no-bias", help="With biases.")]
OutOption = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Also write a figure of W_q, W_k, W_v, W_o with head boundaries (.png, .svg, .pdf)."))]
# The flag's earlier name, kept working and out of --help: every command writes figures with --out.
PngOption = Annotated[Path | None, typer.Option("--png", callback=path_arg, hidden=True)]
VerifyOption = Annotated[bool, typer.Option("--verify", help=(
    "--model: prove attnviz's head slicing through the model's own forward pass: negate "
    "each head's W_q, W_k, W_v rows in turn and check that only that head changes; where "
    "attnviz knows the family's positions, also recompute the layer's attention from the "
    "slices (needs attnviz\\[hf])."))]
