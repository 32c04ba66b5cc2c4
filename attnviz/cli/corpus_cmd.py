"""`attnviz corpus`: options → CorpusRequest → run_corpus (a progress bar on stderr) → the
terminal overview, --json, --csv, --out, --html (rank 0 alone under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnviz.cli.corpus_options import Field, Limit, Long, MaxTokens, Sample, Weighting
from attnviz.cli.heatmap_options import Device, DeviceMap, Dtype, MaxMemory, MemoryBudget
from attnviz.cli.options import Json, Model, choice_option, console, path_arg, plain, positive
from attnviz.core import choices
from attnviz.core.request import MAX_SEED

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnviz.app.corpus import CorpusProgress
    from attnviz.compute.corpus.corpus_result import CorpusResult

Corpus = Annotated[Path, typer.Argument(callback=path_arg, help=(
    "The corpus: a text file with one example per line, JSON lines (with --field), or '-' "
    "for standard input. Read as a stream: any size."))]
Seed = Annotated[int, typer.Option("--seed", min=0, max=MAX_SEED, help=(
    "Seed of --sample and of the bootstrap resamples."))]
Resamples = Annotated[int, typer.Option("--resamples", callback=positive, help=(
    "Bootstrap resamples (examples drawn with replacement) behind each type's stability."))]
Overview = Annotated[choices.CorpusShows, choice_option(choices.CorpusShows, "--overview", help=(
    "What each cell of the layers × heads grid shows: label (the head's type and its "
    "stability) or a statistic (its mean ± half its 95% interval)."))]
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: each statistic per head with 95% error bars, and the settle curve "
    "(.png, .svg, .pdf)."))]
Csv = Annotated[Path | None, typer.Option("--csv", callback=path_arg, help=(
    "Write one row per head: type, stability, each statistic's mean, interval and query "
    "count (.csv)."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an offline page: types, statistics with intervals, the settle curve (.html)."))]
State = Annotated[Path | None, typer.Option("--state", callback=path_arg, help=(
    "Save the partial sums to this file every --save-every batches (atomically), for "
    "--resume; under torchrun each rank writes FILE.rankR."))]
Resume = Annotated[bool, typer.Option("--resume", help=(
    "Continue an interrupted run from --state; refused, naming it, when the model, the "
    "corpus or an option changed."))]
SaveEvery = Annotated[int | None, typer.Option("--save-every", callback=positive, help=(
    "Batches between two saves of --state (default 50; saved at the end of a lookahead "
    "window)."))]


def corpus(
    corpus: Corpus,
    field: Field = None,
    limit: Limit = None,
    sample: Sample = None,
    seed: Seed = 0,
    long: Long = choices.LongExamples.TRUNCATE,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = choices.Dtype.FLOAT32,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    weighting: Weighting = choices.Weighting.ATTENTION,
    resamples: Resamples = 200,
    overview: Overview = choices.CorpusShows.LABEL,
    out: Out = None,
    as_json: Json = False,
    csv: Csv = None,
    html: Html = None,
    max_tokens: MaxTokens = 128,
    memory_budget: MemoryBudget = None,
    state: State = None,
    resume: Resume = False,
    save_every: SaveEvery = None,
) -> None:
    """Head statistics over a corpus: each head's mean with a 95% interval over examples, its
    type with its bootstrap stability, and when that type settled; streamed, resumable, and
    data-parallel under torchrun (default: the bundled model)."""
    from attnviz.app.corpus import CorpusRequest, run_corpus
    from attnviz.app.heatmap_sources import parse_max_memory, parse_memory_budget

    if as_json and overview is not choices.CorpusShows.LABEL:
        from attnviz.errors import UsageError, option

        raise UsageError(f"{option('overview')} chooses what the terminal grid shows, and "
                         f"{option('json')} lists every statistic of every head",
                         fix=f"drop {option('overview')}", option="overview")
    outputs = _check_outputs(corpus, model, out, csv, html)
    request = CorpusRequest(corpus, model, field, device, dtype, device_map,
                            parse_max_memory(max_memory), weighting, max_tokens, long,
                            parse_memory_budget(memory_budget), limit, sample, seed, resamples,
                            state, resume, save_every)
    leader = os.environ.get("RANK", "0") in ("", "0")
    with _progress_bar(leader and not as_json) as report:
        result = run_corpus(request, report)
    if not leader:
        return
    from attnviz.cli.options import with_flags

    result.notes = [with_flags(note) for note in result.notes]  # flags, as errors show them
    _write(result, outputs)
    if as_json:
        from attnviz.cli.options import strict_json

        typer.echo(strict_json(result.to_json()))
    else:
        from attnviz.render.corpus_terminal import print_corpus

        shows = None if overview is choices.CorpusShows.LABEL else _statistic(overview)
        print_corpus(console(), result, shows)
    for path in (p for p in outputs if p is not None):
        console().print(plain(f"wrote {path}"), soft_wrap=True)


def _statistic(shows: choices.CorpusShows) -> str:
    from attnviz.compute.measures.overview import STATISTICS

    return STATISTICS[str(shows)][0]


def _check_outputs(corpus: Path, model: str | None, out: Path | None, csv: Path | None,
                   html: Path | None) -> tuple[Path | None, Path | None, Path | None]:
    from attnviz.app.outputs import check_distinct, check_output_path
    from attnviz.cli.paths import inputs_read
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    read = inputs_read(None, model, corpus, model is None)
    checked = (None if out is None else check_output_path(out, FIGURE_SUFFIXES, read),
               None if csv is None else check_output_path(csv, (".csv",), read, "csv"),
               None if html is None else check_output_path(html, (".html", ".htm"), read,
                                                           "html"))
    check_distinct(*checked)
    return checked


def _write(result: CorpusResult, outputs: tuple[Path | None, Path | None, Path | None]) -> None:
    out, csv, html = outputs
    if out is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.corpus_figure import corpus_figure

        write_figure(corpus_figure(result), out)
    if csv is not None:
        from attnviz.app.outputs import write_output

        write_output(csv, lambda tmp: _write_csv(result, tmp))
    if html is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.corpus_html import corpus_page

        write_page(corpus_page(result), html)


def _write_csv(result: CorpusResult, path: Path) -> None:
    import csv

    rows = result.rows()
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["layer", "head"])
        writer.writeheader()
        writer.writerows(rows)


class _progress_bar:  # noqa: N801 - used as a context manager, like contextlib's
    """A rich progress bar on stderr (examples, examples/s, time left when the total is known),
    only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> Callable[[CorpusProgress], None] | None:
        from attnviz.cli.progress import stderr_console

        terminal = stderr_console()
        if not self.enabled or not terminal.is_terminal or terminal.is_dumb_terminal:
            self.bar = None
            return None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(SpinnerColumn(), TextColumn("examples"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                            TimeRemainingColumn(), console=terminal, transient=True)
        self.task = self.bar.add_task("corpus", total=None, rate="")
        self.bar.start()
        return self.report

    def report(self, progress: CorpusProgress) -> None:
        assert self.bar is not None
        speed = self.bar.tasks[0].speed
        self.bar.update(self.task, completed=progress.done, total=progress.total,
                        rate=f"{speed:.1f}/s" if speed else "")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


