"""Figures (matplotlib Figure + Agg canvas, no pyplot globals, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnviz.app.outputs import atomic_output
from attnviz.compute.split_views import MatrixPanel
from attnviz.errors import printable

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
MAX_HEAD_LABELS = 16
MAX_BOUNDARY_LINES = 128  # head boundaries drawn per panel (every k-th beyond that)
FIGURE_DPI = 100


def new_figure(width: float, height: float, constrained: bool = True,
               dpi: int = FIGURE_DPI) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi,
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
            twin.set_yticks([c for c, _ in shown], [label for _, label in shown], fontsize=8)
        else:
            twin = ax.secondary_xaxis("top")
            twin.set_xticks([c for c, _ in shown], [label for _, label in shown], fontsize=8,
                            rotation=90)
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="weight value")
    fig.suptitle(label(suptitle, 200), fontsize=12, parse_math=False)
    return fig


def _centers(boundaries: list[int], length: int) -> list[float]:
    return [(a + b) / 2 for a, b in zip(boundaries[:-1], boundaries[1:], strict=True)]


# Heatmap figures. Sizes in inches; text at TEXT_PT or more, so labels read at 100 % zoom.
TEXT_PT = 8  # tick labels, panel titles
TITLE_PT = 11
CHAR_INCHES = 0.6 * TEXT_PT / 72  # the width of an average character at TEXT_PT
LABEL_PITCH = 1.2 * TEXT_PT / 72  # the room one token label needs along an axis
LABEL_CHARS = 12  # longest tick label
PANEL_MIN, PANEL_MAX = 2.5, 6.0  # the automatic panel side: grown to label every token
GRID_INCHES = 30.0  # the automatic panel size keeps a grid's panels within this, each way,
GRID_AREA = 400.0  # and their area within this many square inches (a 12 × 12 grid: 1.7 in)
PANEL_TITLE_BAND = 0.26  # above each row of panels
PANEL_GAP = 0.3  # between the columns of panels
MASKED_COLOR = "#c8c8c8"  # masked cells (causal, padding): light grey, never a weight's colour
MAX_MOSAIC_PIXELS = 40_000_000  # the tiled image of all panels, before the dpi is lowered
TICK_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def panel_inches(views: list[Any], size: float | None = None) -> float:
    """The side of one square panel: `size`, else big enough to label every token (within
    PANEL_MIN..PANEL_MAX), smaller as the grid grows so it stays within ~GRID_INCHES."""
    if size is not None:
        return size
    n_rows = len(dict.fromkeys((v.sentence, v.layer) for v in views))
    n_cols = len(dict.fromkeys(v.head for v in views))
    tokens = max(max(v.values.shape) for v in views)
    wanted = min(PANEL_MAX, max(PANEL_MIN, tokens * LABEL_PITCH))
    return max(1.0, min(wanted, GRID_INCHES / n_cols, GRID_INCHES / n_rows,
                        (GRID_AREA / (n_rows * n_cols)) ** 0.5))


def axis_labels(labels: list[str], spans: Any, side: float) -> list[tuple[int, str]]:
    """(cell, text) ticks along one side of a panel: every token when they fit, else every
    k-th as 'index token' (k = 1, 2, 5, 10, …); a downsampled axis names its token ranges."""
    count = len(labels)
    step = next((k for k in TICK_STEPS if side / count * k >= LABEL_PITCH), TICK_STEPS[-1])
    if step == 1 or spans is not None:
        return [(i, labels[i][:LABEL_CHARS]) for i in range(0, count, step)]
    return [(i, f"{i} {labels[i]}"[:LABEL_CHARS]) for i in range(0, count, step)]


def _panel_title(view: Any, sentences: int, side: float) -> str:
    title = view.title if sentences == 1 else f"s{view.sentence + 1} · {view.title}"
    if len(title) * CHAR_INCHES <= side:
        return title
    head = "mean" if view.head is None else f"h{view.head}"
    layer = view.label if view.label is not None else f"L{view.layer}"
    return (f"s{view.sentence + 1} " if sentences > 1 else "") + f"{layer} {head}"


def _stretch(values: Any, side: int) -> Any:
    """A (rows, cols) map as a side × side block, each cell repeated (nearest): every panel
    fills the same square whatever its sentence's length."""
    import numpy as np

    rows = np.arange(side) * values.shape[0] // side
    cols = np.arange(side) * values.shape[1] // side
    return values[rows][:, cols]


def heatmap_figure(views: list[Any], title: str, scale: str = "max", size: float | None = None,
                   dpi: int | None = None) -> Any:
    """A grid: one row per (sentence, layer), one column per head, one shared colour scale.

    Laid out in bands that never overlap: the title on top, a title band above each row of
    panels, each sentence's key labels below its last row, the colour bar (and the masked-cell
    key) on the right. Every panel is the same square whatever the sentence's length. Masked
    cells (exactly 0) are light grey, apart from the colour scale.

    The panels are tiled into one image on one Axes (white gaps between them): creating and
    laying out an Axes per panel costs ~30 ms each, which makes a 12 × 12 grid take seconds.
    A map with more cells than its panel has pixels is downsampled first (key blocks summed,
    query blocks averaged): matplotlib would otherwise resample every cell of it, and with
    nearest-neighbour interpolation silently drop most of them.
    """
    import textwrap

    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.patches import Rectangle

    from attnviz.compute.maps import downsample
    from attnviz.compute.scale import map_scale

    dpi = dpi or FIGURE_DPI
    side = panel_inches(views, size)
    rows_keys = list(dict.fromkeys((v.sentence, v.layer) for v in views))
    heads = list(dict.fromkeys(v.head for v in views))
    n_rows, n_cols = len(rows_keys), len(heads)
    sentences = list(dict.fromkeys(sentence for sentence, _ in rows_keys))
    # The tiled image's resolution: the output's pixels, unless the image would be huge.
    rows_inches = n_rows * (side + PANEL_TITLE_BAND) + len(sentences) * 1.0
    cols_inches = n_cols * (side + PANEL_GAP)
    ppi = min(float(dpi), (MAX_MOSAIC_PIXELS / (rows_inches * cols_inches)) ** 0.5)
    pixels = max(1, round(side * ppi))
    views = [downsample(v, pixels, pixels) for v in views]
    by_key = {(v.sentence, v.layer, v.head): v for v in views}
    first = {key: next(v for v in views if (v.sentence, v.layer) == key) for key in rows_keys}
    shown = map_scale(scale, [v.values for v in views])

    def label_sets(view: Any) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        return (axis_labels(view.row_labels, view.row_spans, side),
                axis_labels(view.col_labels, view.col_spans, side))

    ticks = {key: label_sets(view) for key, view in first.items()}
    y_chars = max(len(text) for ys, _ in ticks.values() for _, text in ys)
    x_chars = max(len(text) for _, xs in ticks.values() for _, text in xs)
    label_band = 0.15 + x_chars * CHAR_INCHES  # rotated key labels under a sentence's panels
    margin_left = 0.45 + y_chars * CHAR_INCHES
    margin_right = 1.35  # colour bar, its numbers and its label
    margin_bottom = label_band + 0.3  # key labels and the word 'key'
    band, gap = round(PANEL_TITLE_BAND * ppi), round(PANEL_GAP * ppi)
    # Key labels go under the last row of each sentence, and under any row whose keys differ
    # from the next row's (an encoder-decoder: source, target × target, target × source).
    labelled = [r + 1 < n_rows and (rows_keys[r + 1][0] != rows_keys[r][0] or
                                    first[rows_keys[r + 1]].col_labels
                                    != first[rows_keys[r]].col_labels)
                for r in range(n_rows)]
    offsets, y = [], 0
    for r in range(n_rows):
        y += band
        offsets.append(y)
        y += pixels
        if labelled[r]:
            y += round(label_band * ppi)
    mosaic_h, mosaic_w = y, n_cols * pixels + (n_cols - 1) * gap
    width = margin_left + mosaic_w / ppi + margin_right
    wrapped = textwrap.wrap(title, max(20, int(width / (0.6 * TITLE_PT / 72)))) or [""]
    title_band = 0.2 + 0.24 * len(wrapped)
    height = title_band + mosaic_h / ppi + margin_bottom

    masked = shown.vmin / 10 if shown.log else shown.vmin - 1.0  # drawn in the "under" colour
    mosaic = np.full((mosaic_h, mosaic_w), np.nan, dtype=np.float32)
    for r, (sentence, layer) in enumerate(rows_keys):
        for c, head in enumerate(heads):
            view = by_key.get((sentence, layer, head))
            if view is None:
                continue
            block = _stretch(view.values, pixels)
            block = np.where(block == 0.0, masked,
                             np.maximum(block, shown.vmin) if shown.log else block)
            x = c * (pixels + gap)
            mosaic[offsets[r] : offsets[r] + pixels, x : x + pixels] = block

    fig = new_figure(width, height, constrained=False, dpi=dpi)
    ax = fig.add_axes((margin_left / width, margin_bottom / height,
                       mosaic_w / ppi / width, mosaic_h / ppi / height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white", under=MASKED_COLOR)
    norm = LogNorm(shown.vmin, shown.vmax) if shown.log else Normalize(shown.vmin, shown.vmax)
    image = ax.imshow(mosaic, cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
    ax.set_xlim(-0.5, mosaic_w - 0.5)
    ax.set_ylim(mosaic_h - 0.5, -0.5)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(length=0, labelsize=TEXT_PT)

    def centre(offset: int, cell: int, cells: int) -> float:
        return offset + (cell + 0.5) * pixels / cells - 0.5

    y_pos, y_text = [], []
    for r, key in enumerate(rows_keys):
        cells = first[key].values.shape[0]
        for i, text in ticks[key][0]:
            y_pos.append(centre(offsets[r], i, cells))
            y_text.append(text)
    ax.set_yticks(y_pos, y_text)
    last = rows_keys[-1]
    x_pos, x_text = [], []
    for c in range(n_cols):
        cells = first[last].values.shape[1]
        for i, text in ticks[last][1]:
            x_pos.append(centre(c * (pixels + gap), i, cells))
            x_text.append(text)
    ax.set_xticks(x_pos, x_text, rotation=90)
    for r, key in enumerate(rows_keys):
        if labelled[r]:
            # Every head of a row has the same keys: label them under its first panel only
            # (text is most of a big grid's drawing time); the bottom row labels all.
            cells = first[key].values.shape[1]
            for i, text in ticks[key][1]:
                ax.text(centre(0, i, cells), offsets[r] + pixels + 0.1 * ppi, text,
                        fontsize=TEXT_PT, rotation=90, ha="center", va="top")
        for c, head in enumerate(heads):
            view = by_key.get((sentence, key[1], head))
            if view is not None:
                ax.text(c * (pixels + gap) - 0.5, offsets[r] - 0.04 * ppi,
                        _panel_title(view, len(sentences), side), fontsize=TEXT_PT,
                        va="bottom", ha="left")
    ax.set_xlabel("key", fontsize=TEXT_PT + 1)
    ax.set_ylabel("query", fontsize=TEXT_PT + 1)
    # The colour bar beside the panels (at most 4 in tall), the masked-cell key under it.
    bar_height = min(mosaic_h / ppi, 4.0)
    bar_top = margin_bottom + mosaic_h / ppi
    bar_left = margin_left + mosaic_w / ppi + 0.25
    bar = fig.add_axes((bar_left / width, (bar_top - bar_height) / height, 0.15 / width,
                        bar_height / height))
    fig.colorbar(image, cax=bar, label="attention weight")
    bar.tick_params(labelsize=TEXT_PT)
    if any((v.values == 0.0).any() for v in views):
        key_top = bar_top - bar_height - 0.35
        fig.patches.append(Rectangle((bar_left / width, key_top / height), 0.15 / width,
                                     0.15 / height, transform=fig.transFigure,
                                     facecolor=MASKED_COLOR, edgecolor="none"))
        fig.text((bar_left + 0.22) / width, (key_top + 0.075) / height, "masked",
                 fontsize=TEXT_PT, va="center")
    fig.text(0.5, 1 - (title_band / 2) / height, "\n".join(wrapped), fontsize=TITLE_PT,
             ha="center", va="center")
    return fig
