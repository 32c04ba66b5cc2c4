"""`attnviz heatmap`: parse → HeatmapJob → run_heatmap → export, figure, terminal or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
    positive,
    refuse_random_options,
    strict_json,
)
from attnviz.cli.paths import inputs_read
from attnviz.cli.progress import progress
from attnviz.errors import UsageError

if TYPE_CHECKING:
    from attnviz.app.heatmap import HeatmapResult


def heatmap(
    sentences: Annotated[list[str] | None, typer.Argument(help=(
        "One or more sentences (quote each). Tokens are words and punctuation marks."))] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", callback=path_arg, help=(
        "Read sentences from a text file, one per line ('-': standard input)."))] = None,
    weights: Annotated[Path | None, typer.Option("--weights", "-w", callback=path_arg, help=(
        "A checkpoint; default: the bundled 2-layer model with induction heads."))] = None,
    layer: Annotated[str | None, typer.Option("--layer", "-l", help=(
        "Bundled model and --model: all (default), N, -1 or A:B, numbered in the order the "
        "forward pass runs them. Encoder-decoder --model: 'enc N', 'dec N' (decoder "
        "self-attention), 'cross N' (cross-attention), each with N, -1, A:B or all, joined by "
        "commas ('enc -1,cross 0:2'); a bare N is the encoder's. Checkpoint: which attention "
        "layer."))] = None,
    head: Annotated[int | None, typer.Option("--head", help="Show only this head.")] = None,
    average: Annotated[bool, typer.Option("--average", help="Show the mean over heads.")]
    = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
        "Write a figure: a grid of heads per sentence (.png, .svg, .pdf)."))] = None,
    query: Annotated[str | None, typer.Option("--query", "-q", help=(
        "Break one query token down head by head: its q_h, each key's k_h, scores, weights "
        "(an index, or a word)."))] = None,
    sentence: Annotated[int, typer.Option("--sentence", help=(
        "Which sentence --query refers to (1-based)."))] = 1,
    export: Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
        "Write maps, inputs, mask and tokens to a .safetensors file."))] = None,
    html: Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
        "Write an interactive page that works offline: head, model and query views (.html)."))]
    = None,
    stats: Annotated[bool | None, typer.Option("--stats/--no-stats", help=(
        "Print the head-statistics table (default: on)."))] = None,
    maps: Annotated[bool | None, typer.Option("--maps/--no-maps", help=(
        "Print the terminal heatmaps (default: on, unless --out, --export or --html writes "
        "them to a file)."))] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help=(
        "Print only the 'wrote …' lines (and errors): no header, maps or tables."))] = False,
    as_json: Json = False,
    rank: Annotated[bool, typer.Option("--rank", help=(
        "Rank the heads by type (previous-token, first/last-token, special-token, self, "
        "duplicate, induction, broad): the top 3 of each."))] = False,
    probe: Annotated[str | None, typer.Option("--probe", help=(
        "Run on a probe input instead of sentences: 'induction' (random words, each span "
        "repeated) makes induction heads show."))] = None,
    causal: Annotated[bool, typer.Option("--causal", help=(
        "Decoder-style masking: query i sees keys 0..i (the bundled model always is)."))]
    = False,
    positions: Annotated[str, typer.Option("--positions", help=(
        "Standalone layers: add 'sinusoidal' position encodings to the inputs, or 'none'."))]
    = "none",
    device: Annotated[str, typer.Option("--device", help=(
        "auto (a GPU when present), cpu, cuda, cuda:N or mps."))] = "auto",
    model: Model = None,
    dtype: Annotated[str, typer.Option("--dtype", help=(
        "--model: float32, bfloat16 or float16."))] = "float32",
    device_map: Annotated[str | None, typer.Option("--device-map", help=(
        "--model: 'auto' spreads a large model over devices (needs accelerate)."))] = None,
    target: Annotated[list[str] | None, typer.Option("--target", "-t", help=(
        "--model, encoder-decoder: the decoder's text, one --target per sentence in order; "
        "runs the decoder too (its self-attention and its cross-attention over the "
        "sentence)."))] = None,
    random: Annotated[bool, typer.Option("--random", help=(
        "Use a random nn.MultiheadAttention (with -E, -H, --kdim, --vdim, --seed)."))] = False,
    embed_dim: EmbedDim = None,
    num_heads: NumHeads = None,
    num_kv_heads: NumKvHeads = None,
    head_dim: HeadDim = None,
    kdim: KDim = None,
    vdim: VDim = None,
    seed: Seed = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", callback=positive, help=(
        "Longest sentence accepted (attention costs O(L²) per head)."))] = 256,
    max_sentences: Annotated[int, typer.Option("--max-sentences", callback=positive, help=(
        "Most sentences accepted in one batch."))] = 64,
    max_panels: Annotated[int, typer.Option("--max-panels", callback=positive, help=(
        "Most heatmap panels in one --out figure."))] = 256,
    memory_budget: Annotated[str | None, typer.Option("--memory-budget", help=(
        "Memory for attention maps, e.g. 512MB or 2GB (default 256MB). Inputs whose full maps "
        "(sentences × heads × L × S × 4 bytes) fit are computed whole; longer ones in blocks "
        "of query rows sized to fit it, each reduced at once to display maps and statistics "
        "(--export: written to the file). --weights and --random layers."))] = None,
    size: Annotated[float | None, typer.Option("--size", help=(
        "--out: the side of each heatmap panel in inches (default: room for every token's "
        "label, 2.5 to 6, smaller in big grids)."))] = None,
    dpi: Annotated[int, typer.Option("--dpi", help=(
        "--out: dots per inch of a .png figure (its pixel size)."))] = 100,
    scale: Annotated[str, typer.Option("--scale", help=(
        "Colour scale of maps and figures: max (0 to the largest weight shown), fixed (0 to "
        "1) or log (3 decades below the largest)."))] = "max",
) -> None:
    """Run attention on sentences (one padded batch) and show every head's map, its statistics,
    and a figure."""
    from attnviz.app.heatmap import HeatmapJob, parse_memory_budget, run_heatmap
    from attnviz.app.outputs import check_distinct, check_output_path
    from attnviz.compute.inputs import read_sentences
    from attnviz.compute.scale import check_scale
    from attnviz.recognize.base import HeadHints
    from attnviz.render.figure import FIGURE_SUFFIXES
    from attnviz.render.html import HTML_SUFFIXES
    from attnviz.sources.layers import DEFAULT_EMBED_DIM, DEFAULT_NUM_HEADS, RandomSpec

    check_scale(scale)
    check_figure_options(out, size, dpi)
    if quiet:
        loud = [flag for flag, given in (("--maps", maps), ("--stats", stats), ("--rank", rank))
                if given]
        if loud:
            raise UsageError(f"--quiet prints no maps or tables, but {', '.join(loud)} asks for "
                             "one", fix=f"drop --quiet or {', '.join(loud)}")
    writes = out is not None or export is not None or html is not None
    show_maps = (not writes) if maps is None else maps
    out_path = export_path = html_path = None
    if out or export or html:  # every file the run reads is known before anything is computed
        reads = inputs_read(weights, model, file, not (random or weights or model))
        out_path = check_output_path(out, FIGURE_SUFFIXES, reads) if out else None
        export_path = (check_output_path(export, (".safetensors",), reads, "--export")
                       if export else None)
        html_path = check_output_path(html, HTML_SUFFIXES, reads, "--html") if html else None
        check_distinct(out_path, export_path, html_path)
    if not random:
        refuse_random_options({"--embed-dim": embed_dim, "--kdim": kdim, "--vdim": vdim,
                               "--seed": seed}, "--random only", "add --random")
    spec = RandomSpec(DEFAULT_EMBED_DIM if embed_dim is None else embed_dim,
                      DEFAULT_NUM_HEADS if num_heads is None else num_heads, kdim, vdim, True,
                      seed=seed or 0) if random else None
    texts = list(sentences or []) + (read_sentences(
        file, max_tokens, max_sentences, len(sentences or [])) if file else [])
    if probe is not None:
        texts = probe_sentences(probe, texts)
    job = HeatmapJob(
        texts, weights, model, spec, layer, HeadHints(None if random else num_heads,
                                                      num_kv_heads, head_dim),
        causal, positions, device, dtype, device_map, head, average, query, sentence,
        keep_full_maps=export is not None, export_path=export_path,
        memory_budget=parse_memory_budget(memory_budget), max_tokens=max_tokens,
        max_sentences=max_sentences, max_panels=max_panels if out_path else None,
        targets=list(target) if target else None)
    with progress(not (as_json or quiet)) as report:
        result = run_heatmap(job, report)
        if export_path is not None:
            report(f"writing {export_path.name}")
            result.export(export_path)
        if out_path is not None:
            from attnviz.render.figure import heatmap_figure, save_figure

            report(f"drawing the figure {out_path.name}")
            save_figure(heatmap_figure(result.views, result.title(), scale, size, dpi),
                        out_path)
        if html_path is not None:
            from attnviz.render.html import document_from_run, write_html

            report(f"writing the page {html_path.name}")
            write_html(document_from_run(result.run, result.head_stats, result.breakdown),
                       html_path)
    print_warnings(result.warnings)
    if as_json:
        typer.echo(strict_json(result.to_json(ranked=rank)))
        return
    if not quiet:
        print_heatmap(result, stats is not False, show_maps, sentence - 1, scale,
                      maps_written=writes and maps is None)
    if rank:
        from attnviz.render.ranking_terminal import print_ranking

        terminal = console()
        terminal.print()
        print_ranking(terminal, result.ranking())
    for path in (out_path, export_path, html_path):
        if path is not None:
            console().print(plain(f"wrote {path}"), soft_wrap=True)  # one line, for scripts


def print_warnings(warnings: list[str]) -> None:
    """One line each on stderr (so --json stays clean), the text never read as markup."""
    if not warnings:
        return
    from rich.console import Console

    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in warnings:
        errors.print(plain(f"warning: {line}"))


def check_figure_options(out: Path | None, size: float | None, dpi: int) -> None:
    """--size and --dpi shape the --out figure: given without it, or out of range, they are
    usage errors, never ignored."""
    given = [flag for flag, value in (("--size", size is not None), ("--dpi", dpi != 100))
             if value]
    if given and out is None:
        raise UsageError(f"{' and '.join(given)} shape the --out figure",
                         fix="add --out FILE.png, or drop them")
    if size is not None and not 0.5 <= size <= 20:
        raise UsageError(f"--size {size:g} is out of range", fix="choose 0.5 to 20 (inches)",
                         option="--size")
    if not 20 <= dpi <= 1200:
        raise UsageError(f"--dpi {dpi} is out of range", fix="choose 20 to 1200", option="--dpi")


def probe_sentences(probe: str, given: list[str]) -> list[str]:
    """The probe's sentences; a probe replaces sentences, so both at once is a mistake."""
    from attnviz.core.probe import PROBES, induction_probe

    if probe not in PROBES:
        raise UsageError(f"unknown probe {probe!r}", fix=f"use {', '.join(PROBES)}",
                         option="--probe")
    if given:
        raise UsageError("--probe replaces the sentences", fix="drop the sentences or --probe")
    return induction_probe()


def print_heatmap(result: HeatmapResult, show_stats: bool, show_maps: bool,
                  sentence_index: int, scale: str = "max", maps_written: bool = False) -> None:
    """Header lines, terminal maps, the statistics table and the --query breakdown."""
    from attnviz.compute.maps import downsample
    from attnviz.render import maps_terminal as render

    run = result.run
    out = console()
    out.print(plain(f"source  {run.source}   device {run.device}"))
    out.print(plain(f"inputs  {run.inputs_described}"))
    if run.path is not None:
        out.print(plain(f"path    {run.path}"))
    for captured in run.layers:
        causal = run.causal if captured.causal is None else captured.causal
        out.print(plain(f"layer {captured.display_label} ({captured.display_name or 'top level'}, "
                        f"{captured.heads} heads): {captured.method}"
                        + ("; causal" if causal else "")))
    for note in run.notes:
        out.print(plain(f"note: {note}"))
    out.print()
    if show_maps:
        fitted = [downsample(v, 48, max(8, out.width - 10)) for v in result.views]
        render.print_maps(out, fitted, run.batch.sentences, scale,
                          None if run.target is None else run.target.sentences)
    elif maps_written:
        out.print(plain("maps: in the files written below (--maps prints them here too)"),
                  style="dim")
    if show_stats:
        out.print()
        render.print_stats(out, result.head_stats)
    if result.breakdown is not None:
        out.print()
        render.print_query(out, result.breakdown, run.batch.tokens[sentence_index])
