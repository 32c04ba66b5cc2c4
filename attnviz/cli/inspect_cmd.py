"""`attnviz inspect`: parse → InspectRequest → inspect_checkpoint → render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.compound import (
    HEAD_SPEC_KEYS,
    HEAD_SPEC_RENAMED,
    HeadSpec,
    key_values,
    old_spellings,
)
from attnviz.cli.options import (
    Json,
    NumHeads,
    console,
    path_arg,
    strict_json,
)


@old_spellings(*HEAD_SPEC_RENAMED)
def inspect(
    checkpoint: Annotated[Path, typer.Argument(callback=path_arg, help=(
        "A .safetensors or .pt/.pth/.bin file, or a Hugging Face model folder."))],
    layer: Annotated[str | None, typer.Option("--layer", "-l", help=(
        "Show per-head slices and norms of one layer (index or name); reads its tensors."))]
    = None,
    num_heads: NumHeads = None,
    spec: HeadSpec = None,
    scan: Annotated[bool, typer.Option("--scan", help=(
        "Read every attention tensor (one at a time) and count NaN/Inf values."))] = False,
    as_json: Json = False,
) -> None:
    """List every attention layer in a checkpoint: geometry, weight shapes, heads (headers only)."""
    from attnviz.app.inspect_checkpoint import InspectRequest, inspect_checkpoint
    from attnviz.core.request import HeadHints

    sizes = key_values("--spec", spec, HEAD_SPEC_KEYS)
    result = inspect_checkpoint(InspectRequest(checkpoint, layer,
                                               HeadHints(num_heads, **sizes), scan))
    if as_json:
        typer.echo(strict_json(result.doc))
        return
    from attnviz.render.inspect_tables import print_detail, print_inventory

    out = console()
    print_inventory(out, result.doc, result.non_finite, data_read=result.detail is not None)
    if result.detail is not None:
        print_detail(out, result.detail)
