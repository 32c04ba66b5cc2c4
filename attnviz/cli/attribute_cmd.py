"""`attnviz attribute`: parse → AttributeRequest → run_attribute → render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.heatmap_options import Device, Dtype
from attnviz.cli.options import Json, Model, console, path_arg, plain, strict_json
from attnviz.core import choices

Prompts = Annotated[list[str] | None, typer.Argument(
    metavar="PROMPT", help=(
        "Prompts, each decomposed at its chosen position (default: the bundled model's "
        "built-in induction prompt)."))]
Answer = Annotated[str | None, typer.Option("--answer", "-a", help=(
    "The answer token (one token; ' Mary' with its space where the tokenizer marks one). "
    "Default: the model's top prediction, against its runner-up."))]
Wrong = Annotated[str | None, typer.Option("--wrong", help=(
    "The wrong token: the metric is logit(answer) − logit(wrong). Without it, with "
    "--answer: the answer's logit."))]
Position = Annotated[int, typer.Option("--position", "-p", help=(
    "The position whose next-token logits are decomposed (negative: from the end; default "
    "-1, the last token)."))]
Corrupt = Annotated[list[str] | None, typer.Option("--corrupt", "-c", help=(
    "A corrupted prompt, one per prompt: each part's clean − corrupted difference."))]
Pairs = Annotated[Path | None, typer.Option("--pairs", callback=path_arg, help=(
    "A file of prompt pairs, one a line: TSV 'clean<TAB>corrupt<TAB>answer[<TAB>wrong]' or "
    "JSON lines (as attnviz patch reads them): each pair's clean − corrupted difference, and "
    "the mean over the pairs."))]
Target = Annotated[list[str] | None, typer.Option("--target", "-t", help=(
    "An encoder-decoder's decoder text, one per prompt: the decoder is read (start token + "
    "target), its last position predicting the token after the target."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an offline page (.html): the grids coloured, exact values on hover."))]
Top = Annotated[int, typer.Option("--top", help="How many of the largest parts to name.")]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: the layers × heads grid and the layer parts (.png, .svg, .pdf)."))]
Export = Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
    "Write every number: the --json document (.json), or every part as float64 tensors, "
    "the document in the metadata (.safetensors)."))]


def attribute(
    sentences: Prompts = None, model: Model = None, answer: Answer = None, wrong: Wrong = None,
    target: Target = None, position: Position = -1, corrupt: Corrupt = None,
    pairs: Pairs = None, top: Top = 10,
    out: Out = None, export: Export = None, html: Html = None, as_json: Json = False,
    device: Device = "auto",
    dtype: Dtype = choices.Dtype.FLOAT32,
) -> None:
    """Direct logit attribution: each head's, each layer's attention and MLP output's and the
    embeddings' direct contribution to logit(answer) − logit(wrong), the final norm's scale
    frozen; the parts add up to the model's own logit difference."""
    from attnviz.app.attribute import EXPORT_SUFFIXES, AttributeRequest, run_attribute
    from attnviz.app.outputs import check_output_path
    from attnviz.cli.paths import inputs_read
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    read = inputs_read(None, model, pairs, model is None)
    out_path = check_output_path(out, FIGURE_SUFFIXES, read) if out else None
    export_path = check_output_path(export, EXPORT_SUFFIXES, read, "export") if export \
        else None
    html_path = check_output_path(html, (".html",), read, "html") if html else None
    result = run_attribute(AttributeRequest(
        list(sentences or []), model, answer, wrong, position, list(corrupt or []), pairs,
        device, dtype, top, list(target or [])))
    if out_path is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.attribute_figure import attribute_figure

        write_figure(attribute_figure(result), out_path)
    if html_path is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.attribute_html import attribute_page

        write_page(attribute_page(result), html_path)
    if export_path is not None:
        from attnviz.app.attribute import export_attribution

        export_attribution(result, export_path, strict_json(result.to_json()) + "\n")
    if as_json:
        typer.echo(strict_json(result.to_json()))
        return
    from attnviz.render.attribute_terminal import print_attribution

    shown = console()
    print_attribution(shown, result)
    for path in (out_path, export_path, html_path):
        if path is not None:
            shown.print(plain(f"wrote {path}"), soft_wrap=True)
