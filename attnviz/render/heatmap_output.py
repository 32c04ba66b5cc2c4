"""A heatmap run's figure and page, built in one place for the command line (`--out`, `--html`)
and the Python API (`Heatmap.figure()`, `.html()`): the same title, colour-bar legend, generation
marks and notes in both."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attnviz.compute.measures.value_norms import NORM_LEGEND
from attnviz.errors import keyword, with_options

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.render.heatmap_terminal import Drawn


def legend(weighting: str) -> str:
    """The colour bar's label: the weight α, or the value-weighted norm (--weighting norm)."""
    return NORM_LEGEND if weighting == "norm" else "attention weight"


def run_figure_of(result: Drawn, scale: str, size: float | None, dpi: int | None) -> Figure:
    """The grid of the result's maps (one row per sentence and layer), with the
    prompt/generated boundary marked for a generation."""
    from attnviz.render.generate_figure import run_figure

    return run_figure(result.views, result.title(), (scale, size, dpi),
                      legend(result.run.weighting), (result.run, result.generation))


def page_document(result: Drawn, show: Callable[[str], str] = keyword) -> dict[str, Any]:
    """The interactive page's document; `show` names an option in its notes (the CLI: as its
    flag, the API: as its keyword)."""
    from attnviz.render.html_document import document_from_run

    document = document_from_run(result.run, result.head_stats, result.breakdown,
                                 generation=result.generation)
    document["notes"] = [with_options(note, show) for note in document["notes"]]
    return document
