"""`attnviz patch --out`: one heatmap per grid (layers × heads, layers × positions, heads ×
positions), on one colour scale centred at 0 (the corrupted run) with 1 the clean run."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from attnviz.compute.patching.result import PatchResult
from attnviz.render.figure_io import label, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_TICKS = 32


def patch_figure(result: PatchResult) -> Figure:
    """A panel per grid, two panels a row."""
    grids = result.grids
    columns = min(2, max(1, len(grids)))
    rows = max(1, math.ceil(len(grids) / columns))
    fig = new_figure(6.0 * columns, 4.2 * rows + 0.4)
    axes = fig.subplots(rows, columns, squeeze=False)
    values = [abs(v) for g in grids for row in g.mean for v in row if math.isfinite(v)]
    top = max([1.0, *values])
    for ax, grid in zip(axes.flat, grids, strict=False):
        matrix = [[v if math.isfinite(v) else float("nan") for v in row] for row in grid.mean]
        image = ax.imshow(matrix, cmap="RdBu", vmin=-top, vmax=top, interpolation="nearest",
                          aspect="auto")
        ax.set_title(label(f"{grid.title} ({grid.direction})", 70), fontsize=8,
                     parse_math=False)
        if len(grid.cols) <= MAX_TICKS:
            ax.set_xticks(range(len(grid.cols)),
                          [_tick(c, 14) for c in grid.cols], rotation=90, fontsize=6)
        if len(grid.rows) <= MAX_TICKS:
            ax.set_yticks(range(len(grid.rows)), [_tick(r, 10) for r in grid.rows], fontsize=6)
        fig.colorbar(image, ax=ax, fraction=0.04)
    for ax in list(axes.flat)[len(grids):]:
        ax.axis("off")
    fig.suptitle(label(f"activation patching, {result.metric}: 0 = corrupted, 1 = clean", 90),
                 fontsize=9, parse_math=False)
    return fig


def _tick(text: str, limit: int) -> str:
    """A tick label: tick texts parse mathtext, so a token's `$` is escaped."""
    return label(text, limit).replace("$", r"\$")
