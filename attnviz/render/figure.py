"""Figures (matplotlib Figure + Agg canvas, no pyplot globals, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnviz.app.outputs import atomic_output
from attnviz.compute.split import MatrixPanel
from attnviz.errors import printable

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
MAX_HEAD_LABELS = 16
MAX_BOUNDARY_LINES = 128  # head boundaries drawn per panel (every k-th beyond that)
FIGURE_DPI = 100


def new_figure(width: float, height: float, constrained: bool = True) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=FIGURE_DPI,
                 layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def label(text: str, limit: int | None = None) -> str:
    """Figure text from a file or the user: escaped and shortened. Every text artist is also
    created with parse_math=False, so `$\\frac` in a name is drawn as it is, never parsed."""
    shown = printable(text, None)
    return shown if limit is None else shown[:limit]


def save_figure(fig: Any, path: Path) -> None:
    """Write atomically: a failure leaves no partial file. matplotlib's font warnings (a glyph
    missing for a token's script) stay off stderr."""
    import logging
    import warnings

    logger = logging.getLogger("matplotlib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with atomic_output(path) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig.savefig(tmp, format=path.suffix.lstrip(".").lower())
    finally:
        logger.setLevel(level)


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
        edges = panel.boundaries[1:-1]
        for edge in edges[:: max(1, -(-len(edges) // MAX_BOUNDARY_LINES))]:
            if panel.axis == "rows":
                ax.axhline(edge, color="black", linewidth=0.8)
            else:
                ax.axvline(edge, color="black", linewidth=0.8)
        shown = list(zip(centers, panel.labels, strict=True))[::step]
        if panel.axis == "rows":
            twin = ax.secondary_yaxis("right")
            twin.set_yticks([c for c, _ in shown], [text for _, text in shown], fontsize=7,
                            parse_math=False)
        else:
            twin = ax.secondary_xaxis("top")
            twin.set_xticks([c for c, _ in shown], [text for _, text in shown], fontsize=7,
                            rotation=90, parse_math=False)
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="weight value")
    fig.suptitle(label(suptitle, 200), fontsize=12, parse_math=False)
    return fig


def _centers(boundaries: list[int], length: int) -> list[float]:
    return [(a + b) / 2 for a, b in zip(boundaries[:-1], boundaries[1:], strict=True)]


MAX_TICK_LABELS = 40


def panel_inches(views: list[Any]) -> float:
    """The side of one square panel: smaller as the grid grows, so the figure stays ~18 in."""
    n_rows = len(dict.fromkeys((v.sentence, v.layer) for v in views))
    n_cols = len(dict.fromkeys(v.head for v in views))
    size = max(max(v.values.shape) for v in views)
    return min(2.2 if size <= 16 else 2.8, max(1.2, 18 / max(n_rows, n_cols)))


def heatmap_figure(views: list[Any], title: str) -> Any:
    """A grid: one row per (sentence, layer), one column per head, one shared colour scale.

    The panels are tiled into one image on one Axes (white gaps between them): creating and
    laying out an Axes per panel costs ~30 ms each, which makes a 12 × 12 grid take seconds.
    A map with more cells than its panel has pixels is downsampled first (key blocks summed,
    query blocks averaged): matplotlib would otherwise resample every cell of it, and with
    nearest-neighbour interpolation silently drop most of them.
    """
    import numpy as np

    from attnviz.compute.maps import downsample

    side = panel_inches(views)
    pixels = int(side * FIGURE_DPI)
    views = [downsample(v, pixels, pixels) for v in views]
    rows_keys = list(dict.fromkeys((v.sentence, v.layer) for v in views))
    heads = list(dict.fromkeys(v.head for v in views))
    by_key = {(v.sentence, v.layer, v.head): v for v in views}
    size = max(max(v.values.shape) for v in views)  # cells per panel side
    gap = max(1, size // 6)
    step = size + gap
    n_rows, n_cols = len(rows_keys), len(heads)
    sentences = list(dict.fromkeys(sentence for sentence, _ in rows_keys))
    # Below the last row of each sentence, room for that sentence's key labels.
    label_room = int(size * 0.45) + gap if len(sentences) > 1 else 0
    offsets, y = [], 0
    for r, (sentence, _) in enumerate(rows_keys):
        offsets.append(y)
        last_of_sentence = r + 1 == n_rows or rows_keys[r + 1][0] != sentence
        y += step + (label_room if last_of_sentence and r + 1 < n_rows else 0)
    mosaic = np.full((y - gap, n_cols * step - gap), np.nan, dtype=np.float32)
    for r, (sentence, layer) in enumerate(rows_keys):
        for c, head in enumerate(heads):
            view = by_key.get((sentence, layer, head))
            if view is not None:
                rows, cols = view.values.shape
                mosaic[offsets[r] : offsets[r] + rows, c * step : c * step + cols] = view.values
    extra_height = side * (mosaic.shape[0] / step - n_rows)
    max_labels = max(2, int(side * 72 / 9))
    margin_left, margin_bottom, margin_top, margin_right = 0.9, 0.8, 0.45, 1.2  # inches
    width = margin_left + margin_right + side * n_cols
    height = margin_bottom + margin_top + side * n_rows + extra_height
    fig = new_figure(width, height, constrained=False)
    ax = fig.add_axes((margin_left / width, margin_bottom / height,
                       1 - (margin_left + margin_right) / width,
                       1 - (margin_bottom + margin_top) / height))
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    vmax = max(float(v.values.max()) for v in views) or 1.0
    image = ax.imshow(mosaic, cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest",
                      aspect="auto")
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(length=0, labelsize=6)
    first = {sentence: by_key[(sentence, layer, heads[0])] for sentence, layer in rows_keys
             if (sentence, layer, heads[0]) in by_key}
    y_pos, y_text = [], []
    for r, (sentence, _) in enumerate(rows_keys):
        labels = first[sentence].row_labels
        for i in _label_steps(len(labels), max_labels):
            y_pos.append(offsets[r] + i)
            y_text.append(label(labels[i], 12))
    ax.set_yticks(y_pos, y_text, parse_math=False)
    last_sentence = rows_keys[-1][0]
    x_pos, x_text = [], []
    for c in range(n_cols):
        labels = first[last_sentence].col_labels
        for i in _label_steps(len(labels), max_labels):
            x_pos.append(c * step + i)
            x_text.append(label(labels[i], 12))
    ax.set_xticks(x_pos, x_text, rotation=90, parse_math=False)
    for r, (sentence, layer) in enumerate(rows_keys):
        last_of_sentence = r + 1 == n_rows or rows_keys[r + 1][0] != sentence
        if last_of_sentence and sentence != last_sentence:
            # Every head of a sentence has the same keys: label them under its first panel
            # only (text is most of a big grid's drawing time); the bottom row labels all.
            labels = first[sentence].col_labels
            rows = first[sentence].values.shape[0]
            for i in _label_steps(len(labels), max_labels):
                ax.text(i, offsets[r] + rows - 0.3, label(labels[i], 12), fontsize=6,
                        rotation=90, ha="center", va="top", parse_math=False)
        for c, head in enumerate(heads):
            view = by_key.get((sentence, layer, head))
            if view is not None:
                ax.text(c * step - 0.5, offsets[r] - 0.7, label(f"s{sentence + 1} · {view.title}"),
                        fontsize=7, va="bottom", ha="left", parse_math=False)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    # 0.8 in right of the bar: tick labels as wide as "0.010" plus the rotated label
    bar = fig.add_axes((1 - 0.95 / width, 0.25, 0.15 / width, 0.5))
    fig.colorbar(image, cax=bar, label="attention weight")
    fig.suptitle(label(title, 200), fontsize=9, parse_math=False)
    return fig


def _label_steps(count: int, most: int) -> range:
    return range(0, count, max(1, -(-count // min(most, MAX_TICK_LABELS))))
