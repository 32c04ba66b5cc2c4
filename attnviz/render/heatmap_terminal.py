"""The terminal view of a heatmap run (`attnviz heatmap`, `generate`, `ablate`): the header (source,
inputs, layers, notes), the overview, the maps, the scorecard, the statistics table and the
--query breakdown, in that order. It draws a result; what to show is decided by the caller."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from attnviz.core.choices import ColorScale, OverviewShows
from attnviz.errors import keyword, with_options
from attnviz.render.safe import safe_text

if TYPE_CHECKING:
    from rich.console import Console

    from attnviz.compute.forward_pass.results import AttentionRun

MAX_LISTED_TOKENS = 48  # tokens listed per sentence above an overview


class Drawn(Protocol):
    """What the view reads of a run's result (attnviz.app.heatmap.HeatmapResult: render draws
    results and never imports the use cases)."""

    @property
    def run(self) -> AttentionRun: ...
    @property
    def views(self) -> list[Any]: ...
    @property
    def head_stats(self) -> list[Any]: ...
    @property
    def breakdown(self) -> Any: ...
    @property
    def generation(self) -> Any: ...
    @property
    def focus(self) -> Any: ...
    @property
    def ablation(self) -> Any: ...
    def overview(self, shows: OverviewShows = ...) -> Any: ...
    def title(self) -> str: ...


@dataclass(frozen=True)
class TerminalView:
    """What the terminal shows of a run."""

    maps: bool
    stats: bool
    overview: OverviewShows | None  # what the layers × heads overview shows; None: none
    maps_written: bool  # maps went to files only: say where they are
    sentence_index: int = 0  # the sentence --query refers to
    scale: ColorScale = ColorScale.MAX


def print_heatmap(out: Console, result: Drawn, shown: TerminalView,
                  show: Callable[[str], str] = keyword) -> None:
    """Header lines, the overview, terminal maps, the statistics table and the --query
    breakdown; `show` names an option in the run's notes (the CLI: as its flag)."""
    from attnviz.compute.display.views import downsample
    from attnviz.render.maps_terminal import print_maps, print_stats
    from attnviz.render.query_terminal import print_query

    run = result.run
    print_header(out, run, compact=shown.overview is not None and not shown.maps, show=show)
    if result.generation is not None:
        from attnviz.render.generate_terminal import print_generation

        print_generation(out, result.generation, result.focus)
    if shown.overview is not None:
        from attnviz.render.overview_terminal import print_overview

        print_overview(out, result.overview(shown.overview))
        out.print()
    if shown.maps:
        fitted = [downsample(v, 48, max(8, out.width - 10)) for v in result.views]
        print_maps(out, fitted, run.batch.sentences, shown.scale,
                   None if run.target is None else run.target.sentences)
    elif shown.maps_written:
        out.print(safe_text(f"maps: in the files written below ({show('maps')} prints them "
                            "here too)"), style="dim")
    if result.ablation is not None:
        from attnviz.render.ablation_terminal import print_scorecard

        out.print()
        print_scorecard(out, result.ablation, result.head_stats)
    if shown.stats:
        out.print()
        print_stats(out, result.head_stats)
    if result.breakdown is not None:
        out.print()
        print_query(out, result.breakdown, run.batch.tokens[shown.sentence_index])


def print_header(out: Console, run: AttentionRun, compact: bool,
                 show: Callable[[str], str] = keyword) -> None:
    """Source, inputs, path, layers and notes; `compact` (an overview without maps): one line
    per kind of layer, and each sentence's tokens, which no map shows then."""
    from attnviz.errors import elide_at_boundaries

    # one line: a long path loses whole middle components (--json and --export have it exact)
    device = f"   device {run.device}"
    out.print(safe_text(f"source  {elide_at_boundaries(run.source, out.width - 8 - len(device))}"
                        f"{device}"))
    out.print(safe_text(f"inputs  {run.inputs_described}"))
    if run.path is not None:
        out.print(safe_text(f"path    {run.path}"))
    kinds: dict[tuple[int, str, bool], list[str]] = {}
    for captured in run.layers:
        causal = run.causal if captured.causal is None else captured.causal
        described = (captured.heads, captured.method, causal)
        if compact:
            kinds.setdefault(described, []).append(captured.label)
            continue
        out.print(safe_text(
            f"layer {captured.label} ({captured.name or 'top level'}, "
            f"{captured.heads} heads): {captured.method}" + ("; causal" if causal else "")))
    for (heads, method, causal), labels in kinds.items():
        out.print(safe_text(f"layer{'s' if len(labels) > 1 else ''} {_span(labels)} ({heads} "
                            f"heads): {method}" + ("; causal" if causal else "")))
    for note in run.notes:
        out.print(safe_text(f"note: {with_options(note, show)}"))
    if compact:
        _print_tokens(out, "sentence", run.batch.tokens)
        if run.target is not None:
            _print_tokens(out, "target", run.target.tokens)
    out.print()


def _span(labels: list[str]) -> str:
    """'0-23' for consecutive layer numbers, else the labels listed."""
    if len(labels) > 2 and all(label.isdigit() for label in labels) and \
            [int(label) for label in labels] == list(range(int(labels[0]), int(labels[-1]) + 1)):
        return f"{labels[0]}-{labels[-1]}"
    return ", ".join(labels)


def _print_tokens(out: Console, what: str, tokens: list[list[str]]) -> None:
    for b, sentence in enumerate(tokens, 1):
        listed = " ".join(sentence[:MAX_LISTED_TOKENS]) + (
            f" … {len(sentence) - MAX_LISTED_TOKENS} more" if len(sentence) > MAX_LISTED_TOKENS
            else "")
        out.print(safe_text(f"{what} {b} ({len(sentence)} tokens): {listed}"), overflow="fold")
