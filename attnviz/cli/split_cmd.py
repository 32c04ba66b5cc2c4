"""`attnviz split`: parse → SplitRequest → run_split → render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.options import (
    EmbedDim,
    HeadDim,
    Json,
    KDim,
    Model,
    NumHeads,
    NumKvHeads,
    Seed,
    VDim,
    console,
    path_arg,
    plain,
    refuse_random_options,
    strict_json,
)
from attnviz.cli.paths import inputs_read
from attnviz.errors import UsageError


def split(
    weights: Annotated[Path | None, typer.Option("--weights", "-w", callback=path_arg, help=(
        "A checkpoint (.safetensors, .pt/.pth/.bin, or a model folder) instead of random init."))]
    = None,
    layer: Annotated[str | None, typer.Option("--layer", "-l", help=(
        "Which attention layer: an index from 'attnviz inspect' or its name (--model: the "
        "model's own layer index)."))] = None,
    embed_dim: EmbedDim = None,
    num_heads: NumHeads = None,
    num_kv_heads: NumKvHeads = None,
    head_dim: HeadDim = None,
    kdim: KDim = None,
    vdim: VDim = None,
    bias: Annotated[bool, typer.Option("--bias/--no-bias", help="Random init: with biases.")]
    = True,
    seed: Seed = None,
    png: Annotated[Path | None, typer.Option("--png", callback=path_arg, help=(
        "Also write a figure of W_q, W_k, W_v, W_o with head boundaries (.png, .svg, .pdf)."))]
    = None,
    as_json: Json = False,
    model: Model = None,
    verify: Annotated[bool, typer.Option("--verify", help=(
        "--model: prove attnviz's head slicing through the model's own forward pass: negate "
        "each head's W_q, W_k, W_v rows in turn and check that only that head changes; where "
        "attnviz knows the family's positions, also recompute the layer's attention from the "
        "slices (needs attnviz\\[hf])."))] = False,
) -> None:
    """Show how the heads split W_q, W_k, W_v (by rows) and W_o (by columns), and prove it
    against torch's own forward."""
    from attnviz.app.outputs import check_output_path
    from attnviz.app.split import SplitRequest, run_split
    from attnviz.recognize.base import HeadHints
    from attnviz.render.figure import FIGURE_SUFFIXES
    from attnviz.sources.layers import DEFAULT_EMBED_DIM, DEFAULT_NUM_HEADS, RandomSpec

    png_path = check_output_path(png, FIGURE_SUFFIXES, inputs_read(weights, model, None, False),
                                 "--png") if png else None
    if weights is not None or model is not None:
        refuse_random_options({"--embed-dim": embed_dim, "--kdim": kdim, "--vdim": vdim},
                              "random init only; a checkpoint's shapes come from its weights",
                              "drop them")
    if not bias and (weights is not None or model is not None):
        raise UsageError("--no-bias applies to random init only", fix="drop it")
    random = None
    if weights is None and model is None:
        random = RandomSpec(DEFAULT_EMBED_DIM if embed_dim is None else embed_dim,
                            DEFAULT_NUM_HEADS if num_heads is None else num_heads,
                            kdim, vdim, bias, seed=seed or 0)
    result = run_split(SplitRequest(weights, model, layer, HeadHints(
        None if random else num_heads, num_kv_heads, head_dim), random, seed or 0, verify))
    if png_path is not None:
        from attnviz.render.figure import save_figure, split_figure

        save_figure(split_figure(result.matrix_panels(), result.title), png_path)
    if as_json:
        typer.echo(strict_json(result.to_json()))
    else:
        from attnviz.render.split_terminal import (
            LABEL_WIDTH,
            ablation_lines,
            print_split,
            verify_lines,
        )

        out = console()
        picture = result.band_picture(max(8, min(out.width, 120) - LABEL_WIDTH))
        print_split(out, result.report, picture, result.explanation(), result.source)
        if result.ablation is not None:
            out.print()
            out.print(ablation_lines(result.ablation, result.recompute_skipped))
        if result.verified is not None:
            out.print()
            out.print(verify_lines(result.verified, list(result.sentences)))
        if png_path is not None:
            out.print(plain(f"wrote {png_path}"))
    if result.failure is not None:
        raise result.failure
