"""`attnviz tokens`: parse → TokensRequest → run_tokens → render (terminal, --json, --out,
--html, --export)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnviz.cli.heatmap_options import (
    Device,
    Dpi,
    Dtype,
    File,
    MaxSentences,
    MaxTokens,
    MemoryBudget,
    Sentences,
)
from attnviz.cli.options import Json, Model, choice_option, path_arg, plain
from attnviz.core import choices
from attnviz.core.choices import Erase, HeadReduce, TokenMethod

Target = Annotated[list[str] | None, typer.Option("--target", "-t", help=(
    "--model, encoder-decoder: the decoder's text, one --target per sentence in order; traces "
    "a decoder position back to the source through the decoder's self- and cross-attention "
    "and the encoder, with every method."))]
Position = Annotated[str | None, typer.Option("--position", "-p", help=(
    "The output position traced back: an index (negative from the end) or a word (default: "
    "the last token for a causal model, the first for an encoder; with --target, a decoder "
    "token, default its last)."))]
Method = Annotated[list[TokenMethod] | None, choice_option(TokenMethod, "--method", help=(
    "rollout, flow (exact max flow; refused past its token limit), norms (Kobayashi et al. "
    "2021) or alti (Ferrando et al. 2022); repeat for several (default: every method the "
    "input allows)."))]
Heads = Annotated[HeadReduce, choice_option(HeadReduce, "--heads", help=(
    "Rollout and flow: how a layer's heads become one map: mean, max or min."))]
ResidualWeight = Annotated[float, typer.Option("--residual-weight", help=(
    "Rollout and flow: weight w of the identity in w·I + (1 − w)·A, for the residual."))]
Check = Annotated[bool, typer.Option("--check/--no-check", help=(
    "Leave-one-out: erase each input token, rerun the model, and rank-correlate each "
    "method with the effect on the output."))]
EraseOption = Annotated[Erase, choice_option(Erase, "--erase", help=(
    "How a token is erased: mask (as the model masks padding: no query reads it) or baseline "
    "(replaced by --baseline)."))]
Baseline = Annotated[str | None, typer.Option("--baseline", help=(
    "--erase baseline: the replacing token (default: the model's mask, pad or unknown token; "
    "the bundled model: '<pad>')."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: the methods side by side, and layers × tokens of how each builds up "
    "(.png, .svg, .pdf)."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an offline page with the route view: tokens × layers, edges as thick as their "
    "contribution; click a token to follow it (.html)."))]
Export = Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
    "Write every vector and matrix to a .safetensors file."))]


def tokens(
    sentences: Sentences = None, file: File = None, model: Model = None,
    target: Target = None, position: Position = None, method: Method = None,
    heads: Heads = HeadReduce.MEAN,
    residual_weight: ResidualWeight = 0.5, check: Check = True,
    erase: EraseOption = Erase.MASK, baseline: Baseline = None,
    out: Out = None, html: Html = None, export: Export = None, as_json: Json = False,
    dpi: Dpi = 100, device: Device = "cpu", dtype: Dtype = choices.Dtype.FLOAT32,
    max_tokens: MaxTokens = 256, max_sentences: MaxSentences = 64,
    memory_budget: MemoryBudget = None,
) -> None:
    """Which input tokens reach one output position through all layers: attention rollout, flow,
    and residual-aware contributions side by side, checked against erasing each token
    (default: the bundled model)."""
    from attnviz.app.heatmap_sources import parse_memory_budget
    from attnviz.app.outputs import check_distinct, check_output_path
    from attnviz.app.tokens import TokensRequest, run_tokens
    from attnviz.cli.paths import inputs_read
    from attnviz.errors import UsageError
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    read = inputs_read(None, model, file, model is None)
    out_path = check_output_path(out, FIGURE_SUFFIXES, read) if out else None
    html_path = check_output_path(html, (".html", ".htm"), read, "html") if html else None
    export_path = check_output_path(export, (".safetensors",), read, "export") \
        if export else None
    check_distinct(out_path, html_path, export_path)
    if out is None and dpi != 100:
        raise UsageError("--dpi applies to --out", fix="add --out FILE.png, or drop --dpi",
                         option="dpi")
    texts = list(sentences or [])
    if file is not None:
        from attnviz.app.sentence_file import read_sentences

        texts += read_sentences(file, max_tokens, max_sentences, len(texts))
    result = run_tokens(TokensRequest(
        texts, model, position, tuple(method) if method else None, heads, residual_weight,
        check, erase, baseline, parse_memory_budget(memory_budget), max_tokens, max_sentences,
        device, dtype, tuple(target) if target else None,
        keep_matrices=as_json or html_path is not None or export_path is not None))
    written = []
    if export_path is not None:
        from attnviz.app.tokens_export import write_export

        write_export(result, export_path)
        written.append(export_path)
    if out_path is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.tokens_figure import tokens_figure

        write_figure(tokens_figure(result, dpi), out_path)
        written.append(out_path)
    if html_path is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.tokens_html import tokens_page

        write_page(tokens_page(result), html_path)
        written.append(html_path)
    if as_json:
        from attnviz.cli.options import strict_json

        typer.echo(strict_json(result.to_json()))
        return
    from attnviz.cli.options import console
    from attnviz.render.tokens_terminal import print_tokens

    shown = console()
    print_tokens(shown, result)
    for path in written:
        shown.print(plain(f"wrote {path}"), soft_wrap=True)
