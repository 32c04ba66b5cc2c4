"""`attnviz split`: parse → SplitRequest → run_split → render."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnviz.cli.compound import (
    LAYER_SPEC_KEYS,
    LAYER_SPEC_RENAMED,
    LayerSpec,
    key_values,
    old_spellings,
)
from attnviz.cli.options import (
    Json,
    Model,
    NumHeads,
    console,
    plain,
    strict_json,
)
from attnviz.cli.paths import inputs_read
from attnviz.cli.split_options import (
    BiasOption,
    LayerOption,
    OutOption,
    PngOption,
    VerifyOption,
    WeightsOption,
)
from attnviz.errors import UsageError

SplitRandom = Annotated[bool, typer.Option("--random", help=(
    "A random nn.MultiheadAttention (its size: -H and --spec; the default without --weights "
    "or --model)."))]

if TYPE_CHECKING:
    from attnviz.app.split import SplitResult


@old_spellings(*LAYER_SPEC_RENAMED)
def split(
    weights: WeightsOption = None,
    layer: LayerOption = None,
    random: SplitRandom = False,
    num_heads: NumHeads = None,
    spec: LayerSpec = None,
    bias: BiasOption = True,
    out: OutOption = None,
    png: PngOption = None,
    as_json: Json = False,
    model: Model = None,
    verify: VerifyOption = False,
) -> None:
    """Show how the heads split W_q, W_k, W_v (by rows) and W_o (by columns), and prove it
    against torch's own forward."""
    from attnviz.app.outputs import check_output_path
    from attnviz.app.split import SplitRequest, run_split
    from attnviz.core.request import LayerOptions
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    if out is not None and png is not None:
        raise UsageError("--png is the old name of --out: give one of them", fix="drop --png")
    figure = out if out is not None else png
    png_path = check_output_path(figure, FIGURE_SUFFIXES, inputs_read(weights, model, None, False),
                                 "out" if out is not None else "png") if figure else None
    checkpoint = weights is not None or model is not None
    if random and checkpoint:
        given = "--weights" if weights is not None else "--model"
        raise UsageError(f"--random and {given} exclude each other",
                         fix="give one source (split runs random init when given none)")
    if checkpoint and not bias:
        raise UsageError("--no-bias applies to random init only", fix="drop it")
    sizes = key_values("--spec", spec, LAYER_SPEC_KEYS)
    seed = sizes.get("seed")
    random_layer, hints = LayerOptions(num_heads=num_heads, bias=bias, **sizes).build(
        not checkpoint, "random init only; a checkpoint's shapes come from its weights",
        "drop {them}", seed_is_random=False)
    result = run_split(SplitRequest(weights, model, layer, hints, random_layer, seed or 0,
                                    verify))
    if png_path is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.split_figure import split_figure

        write_figure(split_figure(result.matrix_panels(), result.title), png_path)
    if as_json:
        typer.echo(strict_json(result.to_json()))
    else:
        _print_result(result, png_path)
    if result.failure is not None:
        raise result.failure


def _print_result(result: SplitResult, png_path: Path | None) -> None:
    from attnviz.render.split_terminal import (
        LABEL_WIDTH,
        print_split,
        proof_lines,
        verify_lines,
    )

    out = console()
    picture = result.band_picture(max(8, min(out.width, 120) - LABEL_WIDTH))
    print_split(out, result.report, picture, result.explanation(), result.source)
    if result.proof is not None:
        out.print()
        out.print(proof_lines(result.proof, result.recompute_skipped))
    if result.verified is not None:
        out.print()
        out.print(verify_lines(result.verified, list(result.sentences)))
    if png_path is not None:
        out.print(plain(f"wrote {png_path}"), soft_wrap=True)  # one line, for scripts
