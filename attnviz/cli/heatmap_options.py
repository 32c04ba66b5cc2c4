"""`attnviz heatmap`'s own options: declared once as Annotated aliases (names, defaults and help
live here, so the command's signature stays short), and the checks and defaults that turn them
into a job, the files to write and what the terminal shows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnviz.cli.options import (
    choice_option,
    path_arg,
    positive,
)
from attnviz.core import choices
from attnviz.core.choices import ColorScale, OverviewShows
from attnviz.errors import UsageError, option
from attnviz.render.heatmap_terminal import TerminalView

if TYPE_CHECKING:
    from attnviz.app.outputs import ReadSet
    from attnviz.core.request import HeadHints, LayerOptions, RandomSpec

# what to run on
Sentences = Annotated[list[str] | None, typer.Argument(help=(
    "One or more sentences (quote each). Tokens are words and punctuation marks."))]
File = Annotated[Path | None, typer.Option("--file", "-f", callback=path_arg, help=(
    "Read sentences from a text file, one per line ('-': standard input)."))]
Probe = Annotated[choices.Probe | None, choice_option(choices.Probe, "--probe", help=(
    "Run on a probe input instead of sentences: induction (random words, each span "
    "repeated) makes induction heads show."))]

# which weights
Weights = Annotated[Path | None, typer.Option("--weights", "-w", callback=path_arg, help=(
    "A checkpoint; default: the bundled 2-layer model with induction heads."))]
Layer = Annotated[str | None, typer.Option("--layer", "-l", help=(
    "Bundled model and --model: all (default), N, -1 or A:B, numbered in the order the "
    "forward pass runs them. Encoder-decoder --model: 'enc N', 'dec N' (decoder "
    "self-attention), 'cross N' (cross-attention), each with N, -1, A:B or all, joined by "
    "commas ('enc -1,cross 0:2'); a bare N is the encoder's. Checkpoint: which attention "
    "layer."))]
Causal = Annotated[bool, typer.Option("--causal", help=(
    "Decoder-style masking: query i sees keys 0..i (the bundled model always is)."))]
Positions = Annotated[choices.Positions, choice_option(choices.Positions, "--positions", help=(
    "Add sinusoidal position encodings to the layer's inputs, or none."))]
Device = Annotated[str, typer.Option("--device", help=(
    "auto (a GPU when present), cpu, cuda, cuda:N or mps."))]
Dtype = Annotated[choices.Dtype, choice_option(choices.Dtype, "--dtype", metavar="DTYPE", help=(
    "float32, bfloat16, float16, or auto (the checkpoint's own dtype, as transformers 5 "
    "loads it: half the memory of float32 for a bfloat16 model)."))]
MaxMemory = Annotated[str | None, typer.Option("--max-memory", metavar="SIZE", help=(
    "Keep at most SIZE (e.g. 2GB) of the model's weights in memory and offload the rest to "
    "disk, loaded layer by layer as the forward reaches it (accelerate's offload: pip "
    "install accelerate). The maps are the same; the run is slower."))]
DeviceMap = Annotated[str | None, typer.Option("--device-map", help=(
    "'auto' spreads a large model over devices (needs accelerate)."))]
Target = Annotated[list[str] | None, typer.Option("--target", "-t", help=(
    "--model, encoder-decoder: the decoder's text, one --target per sentence in order; "
    "runs the decoder too (its self-attention and its cross-attention over the "
    "sentence)."))]
Random = Annotated[bool, typer.Option("--random", help=(
    "Use a random nn.MultiheadAttention (with -E, -H, --kdim, --vdim, --seed)."))]
RandomLayer = Annotated[bool, typer.Option("--random", help=(
    "Use a random nn.MultiheadAttention (its size: -H and --spec)."))]

# what to show
Head = Annotated[int | None, typer.Option("--head", help="Show only this head.")]
Average = Annotated[bool, typer.Option("--average", help="Show the mean over heads.")]
Query = Annotated[str | None, typer.Option("--query", "-q", help=(
    "Break one query token down head by head: its q_h, each key's k_h, scores, weights "
    "(an index, or a word)."))]
Sentence = Annotated[int, typer.Option("--sentence", help=(
    "Which sentence --query refers to (1-based)."))]
Stats = Annotated[bool | None, typer.Option("--stats/--no-stats", help=(
    "Print the head-statistics table (default: on, except beside --model's overview)."))]
Maps = Annotated[bool | None, typer.Option("--maps/--no-maps", help=(
    "Print the terminal heatmaps (default: on, unless --out, --export or --html writes "
    "them to a file, or --model shows its overview)."))]
Overview = Annotated[OverviewShows | None, choice_option(
    OverviewShows, "--overview", metavar="NAME", help=(
    "Print a layers × heads grid, a cell per head: label (its type: prev, first, last, "
    "spec, self, dup, ind, next, punct, broad, other) or a statistic (entropy, max, "
    "distance, first, previous, last, special, self, duplicate, induction, next, "
    "punctuation, or ablation in 'attnviz ablate'); off: none. Default: label for "
    "--model without --layer, --head or --maps (maps only when asked for)."))]
Quiet = Annotated[bool, typer.Option("--quiet", help=(
    "Print only the 'wrote …' lines (and errors): no header, maps or tables."))]
Rank = Annotated[bool, typer.Option("--rank", help=(
    "Rank the heads by type (previous-token, first/last-token, special-token, self, "
    "duplicate, induction, next-token, punctuation, broad; in 'attnviz ablate' also by "
    "causal effect): the top 3 of each."))]
Weighting = Annotated[choices.Weighting, choice_option(choices.Weighting, "--weighting", help=(
    "What a cell shows: attention (the weight α_ij) or norm (‖α_ij · W_O^h v_j‖, what head h "
    "writes from key j into query i, rows normalized to sum to 1; --export adds the raw "
    "norms as norm.{layer}). Statistics, --overview and --rank read the maps shown."),
    rich_help_panel="Head analysis")]
Scale = Annotated[ColorScale, choice_option(ColorScale, "--scale", help=(
    "Colour scale of maps and figures: max (0 to the largest weight shown), fixed (0 to "
    "1) or log (3 decades below the largest)."))]

# files written
Out = Annotated[Path | None, typer.Option("--out", "-o", callback=path_arg, help=(
    "Write a figure: a grid of heads per sentence (.png, .svg, .pdf)."))]
Export = Annotated[Path | None, typer.Option("--export", callback=path_arg, help=(
    "Write maps, inputs, mask and tokens to a .safetensors file."))]
Html = Annotated[Path | None, typer.Option("--html", callback=path_arg, help=(
    "Write an interactive page that works offline: head, model and query views (.html)."))]
Size = Annotated[float | None, typer.Option("--size", help=(
    "--out: the side of each heatmap panel in inches (default: room for every token's "
    "label, 2.5 to 6, smaller in big grids)."))]
Dpi = Annotated[int, typer.Option("--dpi", help=(
    "--out: dots per inch of a .png figure (its pixel size)."))]

# limits
MaxTokens = Annotated[int, typer.Option("--max-tokens", callback=positive, help=(
    "Longest sentence accepted (attention costs O(L²) per head)."))]
MaxSentences = Annotated[int, typer.Option("--max-sentences", callback=positive, help=(
    "Most sentences accepted in one batch."))]
MaxPanels = Annotated[int, typer.Option("--max-panels", callback=positive, help=(
    "Most heatmap panels in one --out figure."))]
MemoryBudget = Annotated[str | None, typer.Option("--memory-budget", help=(
    "Memory for attention maps, e.g. 512MB or 2GB (default 256MB). Inputs whose full maps "
    "(sentences × heads × L × S × 4 bytes) fit are computed whole; longer ones in blocks "
    "of query rows sized to fit it, each reduced at once to display maps and statistics "
    "(--export: written to the file). With --model, the shown layers' own eager blocks "
    "take at most a quarter of it."))]


@dataclass(frozen=True)
class Shown(TerminalView):
    """What the terminal shows of a run (drawn by attnviz.render.heatmap_terminal), chosen from
    the options and the terminal's defaults."""

    @classmethod
    def choose(cls, overview: OverviewShows | None, maps: bool | None, stats: bool | None,
               writes: bool, model: bool, layer: str | None, head: int | None, average: bool,
               sentence: int, scale: ColorScale) -> Shown:
        """The defaults: maps unless a file holds them; for a --model run that asks for no
        maps in particular, the overview in place of maps and table (`overview_default`)."""
        shows, compact = overview_default(overview, model, layer, head, average, maps)
        show_maps = maps if maps is not None else not (writes or compact)
        return cls(show_maps, stats if stats is not None else not compact, shows,
                   writes and maps is None and not compact, sentence - 1, scale)


def overview_default(shows: OverviewShows | None, model: bool, layer: str | None,
                     head: int | None, average: bool, maps: bool | None
                     ) -> tuple[OverviewShows | None, bool]:
    """(what the terminal overview shows, or None for none; whether it stands in for the maps
    and the statistics table). A --model run that asks for no particular maps (no --layer,
    --head or --maps), whose full maps would run to hundreds of lines, gets the overview in
    their place (the head types unless --overview names a statistic; off: the maps as before);
    any other run gets it beside them when --overview asks. A default of the terminal's, so it
    is decided here, not where the overview is computed (attnviz.compute.measures.overview)."""
    if shows == OverviewShows.OFF:
        return None, False
    compact = model and layer is None and head is None and not average and maps is not True
    return (shows or OverviewShows.LABEL if compact else shows), compact


@dataclass(frozen=True)
class OutputFiles:
    """The files a run writes, each checked against every file it reads."""

    figure: Path | None = None  # --out
    export: Path | None = None  # --export
    html: Path | None = None  # --html
    ablation_figure: Path | None = None  # --ablate with --out: NAME.ablation.png beside it

    @property
    def written(self) -> list[Path]:
        return [path for path in (self.figure, self.export, self.html, self.ablation_figure)
                if path is not None]

    @property
    def any(self) -> bool:
        return bool(self.written)


def output_files(out: Path | None, export: Path | None, html: Path | None,
                 inputs: Callable[[], ReadSet], ablate: bool = False) -> OutputFiles:
    """Every output path checked (suffix, never one of the `inputs()`, distinct) before
    anything runs, the scorecard's figure beside --out included when `ablate`; the inputs
    are resolved only when there is an output to check."""
    if not (out or export or html):
        return OutputFiles()
    reads = inputs()
    from attnviz.app.outputs import check_distinct, check_output_path
    from attnviz.render.figure_io import FIGURE_SUFFIXES

    # The page's and the scorecard's modules import torch: only when asked for (a figure's
    # worker forks before torch is imported, attnviz.cli.figure_worker).
    figure = check_output_path(out, FIGURE_SUFFIXES, reads) if out else None
    exported = check_output_path(export, (".safetensors",), reads, "export") if export else None
    page = ablation = None
    if html:
        from attnviz.render.html import HTML_SUFFIXES

        page = check_output_path(html, HTML_SUFFIXES, reads, "html")
    if figure is not None and ablate:
        from attnviz.render.ablation_figure import figure_path

        ablation = check_output_path(figure_path(figure), FIGURE_SUFFIXES, reads)
    files = OutputFiles(figure, exported, page, ablation)
    check_distinct(files.figure, files.export, files.html, files.ablation_figure)
    return files


def check_quiet(quiet: bool, loud_flags: dict[str, bool | None], written: bool) -> None:
    """--quiet with a flag that asks for printed output is a contradiction, never resolved
    silently; so is --quiet with no file to write (the run would show nothing at all)."""
    loud = [flag for flag, given in loud_flags.items() if given]
    if quiet and loud:
        raise UsageError(f"--quiet prints no maps or tables, but {', '.join(loud)} asks for "
                         "one", fix=f"drop --quiet or {', '.join(loud)}")
    if quiet and not written:
        raise UsageError("--quiet prints only the 'wrote …' lines, and no file is written",
                         fix="add --out, --html or --export, or drop --quiet")


def random_spec(random: bool, sizes: LayerOptions) -> tuple[RandomSpec | None, HeadHints]:
    """--random's layer and the head hints (attnviz.core.request.LayerOptions.build); the random
    layer's options given without --random are usage errors."""
    return sizes.build(random, f"{option('random')} only", f"add {option('random')}")


# what each flag check_display reads is when not given (the command's defaults; `maps`: --maps
# asked for, as --no-maps never contradicts an output that prints no map)
FLAG_DEFAULTS = {"average": False, "scale": ColorScale.MAX, "maps": False, "stats": None,
                 "quiet": False, "size": None, "dpi": 100, "max_panels": 256}


def check_display(shown: Shown, values: dict[str, object], as_json: bool, out: bool) -> None:
    """The CLI-level rules of `attnviz.core.option_rules` (--json with --maps, --average or
    --scale where no map is drawn, --size without --out, ...):
    refused, never ignored."""
    from attnviz.core.option_rules import CLI, check_rules, display_facts, given_options

    quiet = bool(values.get("quiet"))
    draws = out or (shown.maps and not as_json and not quiet)
    check_rules(CLI, given_options(values, FLAG_DEFAULTS),
                display_facts(as_json, quiet, out, draws))


def check_figure_options(out: Path | None, size: float | None, dpi: int) -> None:
    """The figure's size and dpi in range (given without --out, they are refused by
    check_display)."""
    if size is not None and not 0.5 <= size <= 20:
        raise UsageError(f"{option('size')} {size:g} is out of range",
                         fix="choose 0.5 to 20 (inches)", option="size")
    if not 20 <= dpi <= 1200:
        raise UsageError(f"{option('dpi')} {dpi} is out of range", fix="choose 20 to 1200",
                         option="dpi")


def probe_sentences(probe: choices.Probe, given: bool) -> list[str]:
    """The probe's sentences (the one probe, induction); a probe replaces sentences, so both at
    once is a mistake."""
    from attnviz.core.probe import induction_probe

    if given:
        raise UsageError("--probe replaces the sentences", fix="drop the sentences or --probe")
    return induction_probe()


# --- spellings that moved to their own command: one error line naming it, nothing run --------

def moved(command: str) -> Callable[[typer.Context, typer.CallbackParam, object], object]:
    """A hidden option's callback: given at all, it is refused (exit 2) naming the command that
    does its job now (`attnviz generate`, `attnviz ablate`)."""
    def refuse(ctx: typer.Context, param: typer.CallbackParam, value: object) -> object:
        if value is None or value is False:
            return value
        flag = (param.opts or [f"--{param.name}"])[0]
        raise UsageError(f"{flag} moved to its own command",
                         fix=f"use 'attnviz {command} …' (see 'attnviz {command} --help')")
    return refuse


def _moved_option(flag: str, command: str) -> typer.models.OptionInfo:
    """Hidden from --help, its value never reaches the command (a bool one is an on/off flag,
    a str one takes any value: `--generate 4` and `--generate x` are both refused so)."""
    return typer.Option(flag, hidden=True, callback=moved(command), expose_value=False)


OldGenerate = Annotated[str | None, _moved_option("--generate", "generate")]
OldSample = Annotated[bool, _moved_option("--sample", "generate")]
OldTemperature = Annotated[str | None, _moved_option("--temperature", "generate")]
OldTopP = Annotated[str | None, _moved_option("--top-p", "generate")]
OldAblate = Annotated[bool, _moved_option("--ablate", "ablate")]
OldAblateMean = Annotated[bool, _moved_option("--ablate-mean", "ablate")]
