"""`heatmap --generate --out`: the usual figure with the prompt/generated boundary marked on every
panel that shows generated tokens: a line above the first generated token's row (and, where the
keys are the same tokens, left of its column)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.render.figure import FIGURE_DPI, Grid
from attnviz.render.figure_io import isolated

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.compute.results import AttentionRun, MapView
    from attnviz.sources.generate_spec import Generation

BOUNDARY_COLOR = "#ff2d2d"


@isolated
def mark_boundary(fig: Figure, views: list[MapView], title: str, run: AttentionRun,
                  generation: Generation, size: float | None = None,
                  dpi: int | None = None) -> int:
    """Draw the boundary on `fig` (made by `heatmap_figure` from the same views, title, size
    and dpi); returns how many lines were drawn."""
    grid = Grid.lay_out(views, title, size, dpi or FIGURE_DPI)
    ax = fig.axes[0]
    kinds = {layer.index: layer.kind for layer in run.layers}
    drawn = 0
    for r, (sentence, layer) in enumerate(grid.rows_keys):
        kind = kinds.get(layer, "self")
        if kind == "self" and run.target is not None:  # an encoder: no generated tokens
            continue
        first = generation.prompt_lengths[sentence]
        for c, head in enumerate(grid.heads):
            view = grid.by_key.get((sentence, layer, head))
            if view is None:
                continue
            x0, y0, side = c * (grid.pixels + grid.gap), grid.offsets[r], grid.pixels
            row = _cell_edge(first, view.row_spans, view.values.shape[0])
            y = y0 + row * side / view.values.shape[0] - 0.5
            ax.plot([x0 - 0.5, x0 + side - 0.5], [y, y], color=BOUNDARY_COLOR, lw=1.2)
            drawn += 1
            if kind != "cross":
                col = _cell_edge(first, view.col_spans, view.values.shape[1])
                x = x0 + col * side / view.values.shape[1] - 0.5
                ax.plot([x, x], [y0 - 0.5, y0 + side - 0.5], color=BOUNDARY_COLOR, lw=1.2,
                        linestyle=(0, (2, 2)))
                drawn += 1
    return drawn


def _cell_edge(token: int, spans: tuple[tuple[int, int], ...] | None, cells: int) -> int:
    """The displayed cell where token `token` starts (after downsampling, the first cell whose
    span reaches it)."""
    if spans is None:
        return min(token, cells)
    return next((i for i, (start, stop) in enumerate(spans) if stop > token), cells)
