"""Figures (matplotlib Figure + Agg canvas, no pyplot globals, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnviz.output import atomic_output
from attnviz.split import MatrixPanel

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
MAX_HEAD_LABELS = 16


def new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: Path) -> None:
    """Write atomically: a failure leaves no partial file."""
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".").lower())


def split_figure(panels: list[MatrixPanel], suptitle: str) -> Any:
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
        for edge in panel.boundaries[1:-1]:
            if panel.axis == "rows":
                ax.axhline(edge, color="black", linewidth=0.8)
            else:
                ax.axvline(edge, color="black", linewidth=0.8)
        shown = list(zip(centers, panel.labels, strict=True))[::step]
        if panel.axis == "rows":
            twin = ax.secondary_yaxis("right")
            twin.set_yticks([c for c, _ in shown], [label for _, label in shown], fontsize=7)
        else:
            twin = ax.secondary_xaxis("top")
            twin.set_xticks([c for c, _ in shown], [label for _, label in shown], fontsize=7,
                            rotation=90)
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="weight value")
    fig.suptitle(suptitle, fontsize=12)
    return fig


def _centers(boundaries: list[int], length: int) -> list[float]:
    return [(a + b) / 2 for a, b in zip(boundaries[:-1], boundaries[1:], strict=True)]


MAX_TICK_LABELS = 40


def heatmap_figure(views: list[Any], title: str) -> Any:
    """A grid: one row per (sentence, layer), one column per head, one shared colour scale."""
    rows_keys = list(dict.fromkeys((v.sentence, v.layer) for v in views))
    heads = list(dict.fromkeys(v.head for v in views))
    n_rows, n_cols = len(rows_keys), len(heads)
    side = 2.4 if max(len(v.row_labels) for v in views) <= 16 else 3.2
    fig = new_figure(1.2 + side * n_cols, 0.8 + side * n_rows)
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    vmax = max(float(v.values.max()) for v in views) or 1.0
    by_key = {(v.sentence, v.layer, v.head): v for v in views}
    image = None
    for r, (sentence, layer) in enumerate(rows_keys):
        last_of_sentence = r + 1 == n_rows or rows_keys[r + 1][0] != sentence
        for c, head in enumerate(heads):
            ax = axes[r][c]
            view = by_key.get((sentence, layer, head))
            if view is None:
                ax.set_axis_off()
                continue
            image = ax.imshow(view.values, cmap="viridis", vmin=0.0, vmax=vmax,
                              interpolation="nearest", aspect="auto")
            ax.set_title(f"s{sentence + 1} · {view.title}", fontsize=8)
            _ticks(ax.set_yticks, view.row_labels, c == 0)
            _ticks(ax.set_xticks, view.col_labels, last_of_sentence, rotation=90)
            if c == 0:
                ax.set_ylabel("query", fontsize=8)
            if last_of_sentence:
                ax.set_xlabel("key", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
    fig.suptitle(title, fontsize=10)
    return fig


def _ticks(setter: Any, labels: list[str], show: bool, rotation: int = 0) -> None:
    if not show:
        setter([])
        return
    step = max(1, -(-len(labels) // MAX_TICK_LABELS))
    positions = list(range(0, len(labels), step))
    kwargs = {"rotation": rotation} if rotation else {}
    setter(positions, [labels[i][:12] for i in positions], fontsize=7, **kwargs)
