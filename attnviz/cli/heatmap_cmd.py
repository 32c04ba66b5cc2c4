"""`attnviz heatmap`: options → one HeatmapRequest (attnviz.core.request) → run_heatmap →
export, figure, terminal or JSON. `attnviz generate` and `attnviz ablate` (generate_cmd,
ablate_cmd) build the same request with their measure and run it through `run_command`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from attnviz.cli.compound import (
    AVERAGE_RENAMED,
    BUDGET_KEYS,
    BUDGET_RENAMED,
    FIGURE_KEYS,
    FIGURE_RENAMED,
    SENTENCE_RENAMED,
    SPEC_KEYS,
    SPEC_RENAMED,
    Budget,
    Figure,
    HeadOrMean,
    QueryAt,
    Spec,
    head_or_mean,
    key_values,
    old_spellings,
    query_at,
)
from attnviz.cli.figure_worker import FigureJob, FigureWorker
from attnviz.cli.heatmap_options import (
    Causal,
    Device,
    DeviceMap,
    Dtype,
    Export,
    File,
    Html,
    Layer,
    Maps,
    MaxMemory,
    OldAblate,
    OldAblateMean,
    OldGenerate,
    OldSample,
    OldTemperature,
    OldTopP,
    Out,
    OutputFiles,
    Overview,
    Probe,
    Quiet,
    RandomLayer,
    Rank,
    Scale,
    Sentences,
    Shown,
    Stats,
    Target,
    Weighting,
    Weights,
    check_display,
    check_figure_options,
    check_quiet,
    output_files,
    probe_sentences,
    random_spec,
)
from attnviz.cli.options import (
    Json,
    Model,
    NumHeads,
    console,
    flag_of,
    plain,
    strict_json,
)
from attnviz.cli.paths import inputs_read, preload_matplotlib
from attnviz.cli.progress import progress
from attnviz.core import choices

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnviz.app.heatmap import HeatmapResult


@old_spellings(*SPEC_RENAMED, *BUDGET_RENAMED, *FIGURE_RENAMED, AVERAGE_RENAMED,
               SENTENCE_RENAMED)
def heatmap(
    sentences: Sentences = None, file: File = None, probe: Probe = None, target: Target = None,
    weights: Weights = None, model: Model = None, random: RandomLayer = False,
    device: Device = "auto", num_heads: NumHeads = None, causal: Causal = False,
    spec: Spec = None, dtype: Dtype = choices.Dtype.FLOAT32, device_map: DeviceMap = None,
    max_memory: MaxMemory = None, layer: Layer = None, head: HeadOrMean = None,
    query: QueryAt = None, weighting: Weighting = choices.Weighting.ATTENTION,
    out: Out = None, export: Export = None, html: Html = None, as_json: Json = False,
    stats: Stats = None, maps: Maps = None, overview: Overview = None, rank: Rank = False,
    quiet: Quiet = False, scale: Scale = choices.ColorScale.MAX, figure: Figure = None,
    budget: Budget = None,
    old_generate: OldGenerate = None, old_sample: OldSample = False,
    old_temperature: OldTemperature = None, old_top_p: OldTopP = None,
    old_ablate: OldAblate = False, old_ablate_mean: OldAblateMean = False,
) -> None:
    """Run attention on sentences (one padded batch) and show every head's map, its statistics,
    and a figure."""
    if overview == choices.OverviewShows.ABLATION:
        from attnviz.errors import UsageError

        raise UsageError("--overview ablation shows the causal head scorecard, which moved to "
                         "its own command", fix="use 'attnviz ablate … --overview ablation' "
                         "(see 'attnviz ablate --help')")
    run_command(
        sentences=sentences, file=file, probe=probe, target=target, weights=weights,
        model=model, random=random, device=device, num_heads=num_heads, causal=causal,
        dtype=dtype, device_map=device_map, max_memory=max_memory, layer=layer,
        weighting=weighting, out=out, export=export, html=html, as_json=as_json, stats=stats,
        maps=maps, overview=overview, rank=rank, quiet=quiet, scale=scale,
        **key_values("--spec", spec, SPEC_KEYS), **head_or_mean(head), **query_at(query),
        **key_values("--figure", figure, FIGURE_KEYS),
        **key_values("--budget", budget, BUDGET_KEYS))


def run_command(
    sentences: list[str] | None = None, file: Path | None = None, weights: Path | None = None,
    layer: str | None = None, head: int | None = None, average: bool = False,
    out: Path | None = None, query: str | None = None, sentence: int = 1,
    export: Path | None = None, html: Path | None = None, stats: bool | None = None,
    maps: bool | None = None, quiet: bool = False, as_json: bool = False, rank: bool = False,
    overview: choices.OverviewShows | None = None, probe: choices.Probe | None = None,
    causal: bool = False, positions: choices.Positions = choices.Positions.NONE,
    device: str = "auto", model: str | None = None, dtype: choices.Dtype = choices.Dtype.FLOAT32,
    device_map: str | None = None, max_memory: str | None = None,
    target: list[str] | None = None, generate: int | None = None, sample: bool = False,
    temperature: float | None = None, top_p: float | None = None, random: bool = False,
    embed_dim: int | None = None, num_heads: int | None = None, num_kv_heads: int | None = None,
    head_dim: int | None = None, kdim: int | None = None, vdim: int | None = None,
    seed: int | None = None, max_tokens: int = 256, max_sentences: int = 64,
    max_panels: int = 256, memory_budget: str | None = None, size: float | None = None,
    dpi: int = 100, scale: choices.ColorScale = choices.ColorScale.MAX,
    weighting: choices.Weighting = choices.Weighting.ATTENTION,
    ablate: choices.AblationMode | None = None,
) -> None:
    """One run of heatmap, generate or ablate: every option checked, the request built once,
    run, and shown. `generate`: tokens to write (attnviz generate; `seed` then seeds the draw);
    `ablate`: the scorecard's mode (attnviz ablate). Every choice arrives as its Enum member,
    parsed by Typer (attnviz.core.choices)."""
    from attnviz.core.request import (
        HeatmapRequest,
        Inputs,
        LayerOptions,
        Limits,
        Measure,
        Outputs,
        Selection,
        SourceSpec,
    )

    shown = Shown.choose(overview, maps, stats, bool(out or export or html), model is not None,
                         layer, head, average, sentence, scale)
    check_display(shown, {"average": average, "scale": scale, "maps": maps is True,
                          "stats": stats, "quiet": quiet, "size": size, "dpi": dpi,
                          "max_panels": max_panels}, as_json, out is not None)
    check_figure_options(out, size, dpi)
    check_quiet(quiet, {"--maps": maps, "--stats": stats, "--rank": rank,
                        "--overview": overview not in (None, choices.OverviewShows.OFF),
                        # shown in the terminal, or on the page / the scorecard's figure only
                        "--query": query is not None and html is None},
                written=bool(out or export or html))
    files = output_files(out, export, html, lambda: inputs_read(
        weights, model, file, not (random or weights or model)), ablate is not None)
    worker = None
    if files.figure is not None:  # before torch's import: see attnviz.cli.figure_worker
        plain_figure = generate is None and ablate is None
        worker = FigureWorker.start() if plain_figure else None
        if worker is None:
            preload_matplotlib()
    from attnviz.app.generate import generate_spec
    from attnviz.app.heatmap import run_heatmap
    from attnviz.app.heatmap_sources import parse_max_memory, parse_memory_budget
    writes = generate_spec(generate, sample, temperature, top_p, seed if generate else None)
    texts = tuple(sentences or ())
    if probe is not None:
        texts = tuple(probe_sentences(probe, bool(texts) or file is not None))
    layer_spec, hints = random_spec(random, LayerOptions(
        embed_dim, num_heads, num_kv_heads, head_dim, kdim, vdim,
        seed=None if generate else seed))
    request = HeatmapRequest(  # built once; the use case and the source read it as it is
        Inputs(texts, file, tuple(target) if target else None),
        SourceSpec(weights, model, layer_spec, hints, causal, positions, device, dtype,
                   device_map, parse_max_memory(max_memory)),
        Selection(layer, head, average, query, sentence),
        Measure(weighting, ablate, writes),
        Outputs(files.figure, files.html, files.export,
                views=shown.maps or files.figure is not None or files.html is not None),
        Limits(max_tokens, max_sentences, max_panels, parse_memory_budget(memory_budget)))
    try:
        with progress(not (as_json or quiet)) as report:
            result = run_heatmap(request, report)
            write_files(result, files, report, (scale, size, dpi), worker)
    finally:
        if worker is not None:
            worker.close()
    print_warnings(result.warnings)
    show(result, shown, files, as_json, quiet, rank, overview != choices.OverviewShows.OFF)


def show(result: HeatmapResult, shown: Shown, files: OutputFiles, as_json: bool, quiet: bool,
         rank: bool, overview_in_json: bool) -> None:
    """stdout: the JSON document, or the terminal view and ranking; then the 'wrote' lines."""
    if as_json:
        typer.echo(strict_json(result.to_json(
            ranked=rank, overview=(shown.overview or "label") if overview_in_json else None)))
        return
    if not quiet:
        from attnviz.render.heatmap_terminal import print_heatmap

        print_heatmap(console(), result, shown, flag_of)
    if rank:
        from attnviz.render.ranking_terminal import print_ranking

        terminal = console()
        terminal.print()
        if result.run.weighting == "norm":
            terminal.print(plain("ranked on value-weighted maps (‖α·W_O v‖, rows summing to 1)"))
        print_ranking(terminal, result.ranking())
        if result.generation is not None:  # --generate: what those heads attend to
            from attnviz.app.generate import ranked_focus
            from attnviz.render.generate_terminal import print_ranked_focus

            terminal.print()
            print_ranked_focus(terminal, ranked_focus(result.run, result.generation,
                                                      result.ranking()))
    for path in files.written:
        console().print(plain(f"wrote {path}"), soft_wrap=True)  # one line, for scripts


def write_files(result: HeatmapResult, files: OutputFiles, report: Callable[[str], None],
                look: tuple[choices.ColorScale, float | None, int],
                worker: FigureWorker | None = None) -> None:
    """--export, --out and --html, each announced to the progress spinner as it starts; look:
    the figure's (scale, size, dpi); worker: a figure worker ready to draw it."""
    scale, size, dpi = look
    if files.export is not None:
        report(f"writing {files.export.name}")
        result.export(files.export)
    if files.figure is not None:
        from attnviz.cli.paths import write_figure
        from attnviz.render.heatmap_output import legend

        report(f"drawing the figure {files.figure.name}")
        job = FigureJob(result.views, result.title(), scale, size, dpi,
                        legend(result.run.weighting), files.figure)
        if worker is None or result.generation is not None or not worker.draw(job):
            from attnviz.render.heatmap_output import run_figure_of

            write_figure(run_figure_of(result, scale, size, dpi), files.figure)
        if result.ablation is not None:
            from attnviz.render.ablation_figure import ablation_figure

            assert files.ablation_figure is not None  # checked with the others, before the run
            write_figure(ablation_figure(result.ablation, result.head_stats, result.title()),
                         files.ablation_figure)
    if files.html is not None:
        from attnviz.cli.paths import write_page
        from attnviz.render.heatmap_output import page_document
        from attnviz.render.html import render_html

        report(f"writing the page {files.html.name}")
        write_page(render_html(page_document(result, flag_of)), files.html)


def print_warnings(warnings: list[str]) -> None:
    """One line each on stderr (so --json stays clean), the text never read as markup."""
    if not warnings:
        return
    from rich.console import Console

    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in warnings:
        errors.print(plain(f"warning: {line}"))
