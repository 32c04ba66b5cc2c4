"""`attnviz compare`: options → CompareRequest → run_compare → the terminal grids, --json, --csv,
--out, --html (rank 0 alone under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnviz.cli.compound import (
    HEAD_SPEC_KEYS,
    HEAD_SPEC_RENAMED,
    HeadSpec,
    key_values,
    old_spellings,
)
from attnviz.cli.corpus_options import Field, Limit, Long, MaxTokens, Sample, Weighting
from attnviz.cli.heatmap_options import Device, Dtype, MemoryBudget
from attnviz.cli.options import (
    Json,
    Model,
    NumHeads,
    choice_option,
    console,
    path_arg,
    plain,
    strict_json,
)
from attnviz.core import choices
from attnviz.core.request import MAX_SEED

if TYPE_CHECKING:
    from attnviz.compute.comparison.compare_result import CompareResult

Corpus = Annotated[Path | None, typer.Argument(callback=path_arg, help=(
    "A corpus to run through both models: a text file with one example per line, JSON lines "
    "(with --field), or '-' for standard input, read as a stream. Without it only the weights "
    "are compared."))]
Against = Annotated[str | None, typer.Option("--against", "-a", callback=path_arg, help=(
    "Model B, compared with model A (--model or --weights) head by head: a model folder or "
    "cached hub id with --model, a checkpoint with --weights. Same head geometry."))]
Weights = Annotated[Path | None, typer.Option("--weights", "-w", callback=path_arg, help=(
    "Model A as a checkpoint (.safetensors, .pt/.pth/.bin, or a folder): its weights alone "
    "are compared (a corpus needs --model)."))]
Seed = Annotated[int, typer.Option("--seed", min=0, max=MAX_SEED, help=(
    "Seed of --sample's draw."))]
Overview = Annotated[choices.CorpusShows, choice_option(choices.CorpusShows, "--overview", help=(
    "What each cell of the corpus's layers × heads grid shows: a statistic's difference "
    "(against − model) ± half its 95% interval, or label (each head's type in both models). "
    "--json and --csv hold every statistic."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: each head's weight distance, and with a corpus each statistic's "
    "difference per head with its 95% interval as error bars (.png, .svg, .pdf)."))]
Csv = Annotated[Path | None, typer.Option("--csv", callback=path_arg, help=(
    "Write one row per head: its weight comparison and each statistic's value in both "
    "models, difference and interval (.csv)."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an offline page: the weights' layers × heads grid, and with a corpus a tab per "
    "statistic of each head's difference with its 95% interval (.html)."))]


@old_spellings(*HEAD_SPEC_RENAMED)
def compare(
    corpus: Corpus = None,
    model: Model = None,
    against: Against = None,
    weights: Weights = None,
    num_heads: NumHeads = None,
    spec: HeadSpec = None,
    field: Field = None,
    limit: Limit = None,
    sample: Sample = None,
    seed: Seed = 0,
    long: Long = choices.LongExamples.TRUNCATE,
    max_tokens: MaxTokens = 128,
    memory_budget: MemoryBudget = None,
    weighting: Weighting = choices.Weighting.ATTENTION,
    device: Device = "auto",
    dtype: Dtype = choices.Dtype.FLOAT32,
    overview: Overview = choices.CorpusShows.ENTROPY,
    out: Out = None,
    as_json: Json = False,
    csv: Csv = None,
    html: Html = None,
) -> None:
    """Two models with the same head geometry, head by head: which heads' weights are
    byte-identical and how far the others moved; with a corpus, each head's difference per
    statistic over the same examples, with a 95% interval over examples."""
    from attnviz.app.compare import CompareRequest, run_compare
    from attnviz.app.heatmap_sources import parse_memory_budget
    from attnviz.core.request import HeadHints

    shown = _shown(overview, corpus is not None, as_json)
    outputs = _check_outputs(corpus, model, against, weights, out, csv, html)
    hints = HeadHints(num_heads, **key_values("--spec", spec, HEAD_SPEC_KEYS))
    request = CompareRequest(
        against or "", model, weights, corpus, hints,
        field, device, dtype, weighting, max_tokens, long, parse_memory_budget(memory_budget),
        limit, sample, seed)
    leader = os.environ.get("RANK", "0") in ("", "0")
    from attnviz.cli.progress import progress

    with progress(leader and not as_json and corpus is not None) as report:
        def hook(done: int, total: int | None) -> None:
            report(f"examples {done}" + (f"/{total}" if total else ""))

        result = run_compare(request, hook)
    if not leader:
        return
    _write(result, outputs, corpus)
    if as_json:
        typer.echo(strict_json(result.to_json()))
    else:
        from attnviz.render.compare_terminal import print_compare

        print_compare(console(), result, shown)
    for path in (p for p in outputs if p is not None):
        console().print(plain(f"wrote {path}"), soft_wrap=True)


def _shown(overview: choices.CorpusShows, corpus: bool, as_json: bool) -> str:
    """What the corpus grid shows: "label", or a statistic as the corpus sums name it (max is
    max_weight)."""
    from attnviz.compute.measures.overview import STATISTICS
    from attnviz.errors import UsageError, option

    if overview is choices.CorpusShows.ENTROPY:
        return "entropy"
    if not corpus:
        raise UsageError(f"{option('overview')} chooses what the corpus's grid shows: without a "
                         "corpus only the weights are compared",
                         fix="name a corpus file, or drop it", option="overview")
    if as_json:
        raise UsageError(f"{option('overview')} chooses what the terminal grid shows, and "
                         f"{option('json')} holds every statistic",
                         fix=f"drop {option('overview')}", option="overview")
    if overview is choices.CorpusShows.LABEL:
        return "label"
    return STATISTICS[str(overview)][0]


def _check_outputs(corpus: Path | None, model: str | None, against: str | None,
                   weights: Path | None, out: Path | None, csv: Path | None,
                   html: Path | None) -> tuple[Path | None, Path | None, Path | None]:
    from attnviz.app.outputs import check_distinct, check_output_path, read_set
    from attnviz.cli.paths import inputs_read
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    if out is None and csv is None and html is None:
        return None, None, None
    read = inputs_read(weights, model, corpus, False)
    if against is not None:  # model B: a checkpoint (file or folder) or a model
        other = Path(against)
        b = inputs_read(None, against, None, False) if model is not None else read_set(
            [other], [other] if other.is_dir() else [])
        read = type(read)(read.paths | b.paths, read.inodes | b.inodes, read.folders | b.folders)
    checked = (None if out is None else check_output_path(out, FIGURE_SUFFIXES, read),
               None if csv is None else check_output_path(csv, (".csv",), read, "csv"),
               None if html is None else check_output_path(html, (".html", ".htm"), read,
                                                           "html"))
    check_distinct(*checked)
    return checked


def _write(result: CompareResult, outputs: tuple[Path | None, Path | None, Path | None],
           corpus: Path | None) -> None:
    from attnviz.app.compare import write_csv

    out, csv, html = outputs
    if out is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.compare_figure import compare_figure

        write_figure(compare_figure(result), out)
    if csv is not None:
        write_csv(result.rows(), csv)
    if html is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.compare_html import compare_page

        name = None if corpus is None else "standard input" if str(corpus) == "-" else str(corpus)
        write_page(compare_page(result, name), html)
