"""`attnviz circuits`: parse → CircuitsRequest → run_circuits → render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.compound import (
    LAYER_SPEC_KEYS,
    LAYER_SPEC_RENAMED,
    LayerSpec,
    key_values,
    old_spellings,
)
from attnviz.cli.heatmap_options import Device, RandomLayer, random_spec
from attnviz.cli.options import (
    Json,
    Model,
    NumHeads,
    console,
    path_arg,
    plain,
    strict_json,
)
from attnviz.cli.paths import inputs_read
from attnviz.cli.split_options import WeightsOption

Layer = Annotated[str | None, typer.Option("--layer", "-l", help=(
    "all (default), N, -1 or A:B, numbered as 'attnviz inspect' numbers them, or a layer's "
    "name; encoder-decoder models: 'enc N', 'dec N', 'cross N' (each with N, -1, A:B or "
    "all), joined by commas."))]
Composition = Annotated[bool | None, typer.Option("--composition/--no-composition", help=(
    "Q-, K-, V-composition of each head with every head of the earlier layers (default: on "
    "when the chosen layers' weights fit in 1 GiB)."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: singular values per head, and the three composition heatmaps (.png, "
    ".svg, .pdf)."))]


@old_spellings(*LAYER_SPEC_RENAMED)
def circuits(
    weights: WeightsOption = None,
    model: Model = None,
    layer: Layer = None,
    random: RandomLayer = False,
    num_heads: NumHeads = None,
    spec: LayerSpec = None,
    composition: Composition = None,
    out: Out = None,
    as_json: Json = False,
    device: Device = "cpu",
) -> None:
    """Each head's QK circuit (W_Qᵀ W_K: what it matches) and OV circuit (W_O W_V: what it
    writes), and how later heads compose with earlier ones (default: the bundled model)."""
    from attnviz.app.circuits import CircuitsRequest, run_circuits
    from attnviz.app.outputs import check_output_path
    from attnviz.core.request import LayerOptions
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    out_path = check_output_path(out, FIGURE_SUFFIXES, inputs_read(
        weights, model, None, weights is None and model is None)) if out else None
    sizes = key_values("--spec", spec, LAYER_SPEC_KEYS)
    layer_spec, hints = random_spec(random, LayerOptions(num_heads=num_heads, **sizes))
    result = run_circuits(CircuitsRequest(weights, model, layer, hints, layer_spec, composition,
                                          device))
    if out_path is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.circuits_figure import circuits_figure

        write_figure(circuits_figure(result), out_path)
    if as_json:
        typer.echo(strict_json(result.to_json()))
        return
    from attnviz.render.circuits_terminal import print_circuits

    shown = console()
    print_circuits(shown, result)
    if out_path is not None:
        shown.print(plain(f"wrote {out_path}"), soft_wrap=True)  # one line, for scripts
