"""The `split` figure: W_q, W_k, W_v, W_o with the heads' boundaries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.compute.splitting.split_views import MatrixPanel
from attnviz.errors import elide_at_boundaries
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_HEAD_LABELS = 16
MAX_BOUNDARY_LINES = 128  # head boundaries drawn per panel (every k-th beyond that)


@isolated
def split_figure(panels: list[MatrixPanel], suptitle: str) -> Figure:
    """W_q, W_k, W_v, W_o side by side with head boundaries and one shared colour scale."""
    import numpy as np

    fig = new_figure(4.2 * len(panels), 5.0)
    axes = fig.subplots(1, len(panels))
    vmax = max(float(np.abs(p.values).max()) for p in panels) or 1.0
    image = None
    for ax, panel in zip(axes, panels, strict=True):
        out_dim, in_dim = panel.shape
        image = ax.imshow(panel.values, cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                          extent=(0, in_dim, out_dim, 0), aspect="auto", interpolation="nearest")
        ax.set_title(f"{panel.title} {panel.shape[0]}×{panel.shape[1]}", fontsize=11)
        ax.set_xlabel("input features (in)")
        ax.set_ylabel("output features (out)")
        centers = _centers(panel.boundaries, out_dim if panel.axis == "rows" else in_dim)
        step = max(1, -(-len(centers) // MAX_HEAD_LABELS))
        edges = panel.boundaries[1:-1]
        for edge in edges[:: max(1, -(-len(edges) // MAX_BOUNDARY_LINES))]:
            if panel.axis == "rows":
                ax.axhline(edge, color="black", linewidth=0.8)
            else:
                ax.axvline(edge, color="black", linewidth=0.8)
        shown = list(zip(centers, panel.labels, strict=True))[::step]
        if panel.axis == "rows":
            twin = ax.secondary_yaxis("right")
            twin.set_yticks([c for c, _ in shown], [label for _, label in shown], fontsize=8)
        else:
            twin = ax.secondary_xaxis("top")
            twin.set_xticks([c for c, _ in shown], [label for _, label in shown], fontsize=8,
                            rotation=90)
    assert image is not None  # panels is never empty: max() above needs one
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="weight value")
    fig.suptitle(label(elide_at_boundaries(suptitle, 200)), fontsize=12, parse_math=False)
    return fig


def _centers(boundaries: list[int], length: int) -> list[float]:
    return [(a + b) / 2 for a, b in zip(boundaries[:-1], boundaries[1:], strict=True)]
