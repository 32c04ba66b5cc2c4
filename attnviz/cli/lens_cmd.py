"""`attnviz lens`: parse → LensRequest → run_lens → render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.heatmap_options import Device, Dtype
from attnviz.cli.options import Json, Model, console, path_arg, plain, strict_json
from attnviz.core import choices

Prompts = Annotated[list[str] | None, typer.Argument(
    metavar="PROMPT", help=(
        "Prompts (default: the bundled model's built-in induction prompt)."))]
Answer = Annotated[str | None, typer.Option("--answer", "-a", help=(
    "The token whose rank and probability each cell shows (one token). Default: the model's "
    "own top prediction at the last position."))]
Position = Annotated[list[int] | None, typer.Option("--position", "-p", help=(
    "A position to show (repeatable; negative: from the end). Default: every position."))]
Target = Annotated[list[str] | None, typer.Option("--target", "-t", help=(
    "An encoder-decoder's decoder text, one per prompt: the decoder is read (start token + "
    "target), its last position predicting the token after the target."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an offline page (.html): the grids coloured, exact values on hover."))]
Top = Annotated[int, typer.Option("--top", help=(
    "How many top tokens each cell keeps (the grid shows the first; --json all)."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: the answer's probability per layer × position, top tokens "
    "written in (.png, .svg, .pdf)."))]
Export = Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
    "Write every cell's numbers (the --json document) to a .json file."))]


def lens(
    sentences: Prompts = None, model: Model = None, answer: Answer = None,
    target: Target = None, position: Position = None, top: Top = 3, out: Out = None,
    export: Export = None, html: Html = None, as_json: Json = False,
    device: Device = "auto", dtype: Dtype = choices.Dtype.FLOAT32,
) -> None:
    """The logit lens: each layer's residual through the model's own final norm (its own
    statistics per layer) and unembedding — the top tokens, and the answer's rank and
    probability, per layer × position."""
    from attnviz.app.lens import LensRequest, run_lens
    from attnviz.app.outputs import check_output_path
    from attnviz.cli.paths import inputs_read
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    read = inputs_read(None, model, None, model is None)
    out_path = check_output_path(out, FIGURE_SUFFIXES, read) if out else None
    export_path = check_output_path(export, (".json",), read, "export") if export else None
    html_path = check_output_path(html, (".html",), read, "html") if html else None
    result = run_lens(LensRequest(list(sentences or []), model, answer, list(position or []),
                                  top, device, dtype, list(target or [])))
    if out_path is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.lens_figure import lens_figure

        write_figure(lens_figure(result), out_path)
    if html_path is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.lens_html import lens_page

        write_page(lens_page(result), html_path)
    if export_path is not None:
        from attnviz.cli.paths import write_page

        write_page(strict_json(result.to_json()) + "\n", export_path)
    if as_json:
        typer.echo(strict_json(result.to_json()))
        return
    from attnviz.render.lens_terminal import print_lens

    shown = console()
    print_lens(shown, result)
    for path in (out_path, export_path, html_path):
        if path is not None:
            shown.print(plain(f"wrote {path}"), soft_wrap=True)
