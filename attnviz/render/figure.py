"""Heatmap figures: a grid of attention maps, one shared colour scale, tiled into one image."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# The figure basics and the split figure live beside this module; re-exported for callers that
# import every figure from here (cli, api, benchmarks).
from attnviz.render.figure_io import FIGURE_DPI, isolated, new_figure

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage
    from numpy.typing import NDArray

    from attnviz.compute.display.scale import Scale
    from attnviz.compute.display.views import MapView

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


def panel_inches(views: list[MapView], size: float | None = None) -> float:
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


def axis_labels(labels: list[str], spans: tuple[tuple[int, int], ...] | None,
                side: float) -> list[tuple[int, str]]:
    """(cell, text) ticks along one side of a panel: every token when they fit, else every
    k-th as 'index token' (k = 1, 2, 5, 10, …); a downsampled axis names its token ranges."""
    count = len(labels)
    step = next((k for k in TICK_STEPS if side / count * k >= LABEL_PITCH), TICK_STEPS[-1])
    if step == 1 or spans is not None:
        return [(i, labels[i][:LABEL_CHARS]) for i in range(0, count, step)]
    return [(i, f"{i} {labels[i]}"[:LABEL_CHARS]) for i in range(0, count, step)]


def _panel_title(view: MapView, sentences: int, side: float) -> str:
    title = view.title if sentences == 1 else f"s{view.sentence + 1} · {view.title}"
    if len(title) * CHAR_INCHES <= side:
        return title
    head = "mean" if view.head is None else f"h{view.head}"
    layer = view.label if view.label is not None else f"L{view.layer}"
    return (f"s{view.sentence + 1} " if sentences > 1 else "") + f"{layer} {head}"


def _stretch(values: NDArray[np.float32], side: int) -> NDArray[np.float32]:
    """A (rows, cols) map as a side × side block, each cell repeated (nearest): every panel
    fills the same square whatever its sentence's length."""
    import numpy as np

    rows = np.arange(side) * values.shape[0] // side
    cols = np.arange(side) * values.shape[1] // side
    return values[rows][:, cols]


@isolated
def heatmap_figure(views: list[MapView], title: str, scale: str = "max", size: float | None = None,
                   dpi: int | None = None, legend: str = "attention weight") -> Figure:
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
    import matplotlib
    from matplotlib.colors import LogNorm, Normalize

    from attnviz.compute.display.scale import map_scale

    grid = Grid.lay_out(views, title, size, dpi or FIGURE_DPI)
    shown = map_scale(scale, [v.values for v in grid.views])
    fig = new_figure(grid.width, grid.height, constrained=False, dpi=dpi or FIGURE_DPI)
    ax = fig.add_axes((grid.margin_left / grid.width, grid.margin_bottom / grid.height,
                       grid.mosaic_w / grid.ppi / grid.width,
                       grid.mosaic_h / grid.ppi / grid.height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white", under=MASKED_COLOR)
    norm = LogNorm(shown.vmin, shown.vmax) if shown.log else Normalize(shown.vmin, shown.vmax)
    image = ax.imshow(_mosaic(grid, shown), cmap=cmap, norm=norm, interpolation="nearest",
                      aspect="auto")
    ax.set_xlim(-0.5, grid.mosaic_w - 0.5)
    ax.set_ylim(grid.mosaic_h - 0.5, -0.5)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(length=0, labelsize=TEXT_PT)
    _axis_ticks(ax, grid)
    _row_labels(ax, grid)
    ax.set_xlabel("key", fontsize=TEXT_PT + 1)
    ax.set_ylabel("query", fontsize=TEXT_PT + 1)
    _colour_bar(fig, image, grid, legend)
    fig.text(0.5, 1 - (grid.title_band / 2) / grid.height, "\n".join(grid.wrapped),
             fontsize=TITLE_PT, ha="center", va="center")
    return fig


Ticks = tuple[list[tuple[int, str]], list[tuple[int, str]]]  # (query ticks, key ticks)


@dataclass(frozen=True)
class Grid:
    """Where everything of a heatmap grid goes: inches for the figure, pixels for the mosaic."""

    views: list[MapView]  # downsampled to the panel's pixels
    rows_keys: list[tuple[int, int]]  # (sentence, layer) per row of panels
    heads: list[int | None]  # per column
    sentences: int
    side: float  # panel side, inches
    ppi: float  # mosaic pixels per inch
    pixels: int  # panel side, pixels
    ticks: dict[tuple[int, int], Ticks]  # per row, from its first panel
    labelled: list[bool]  # rows with key labels under them
    offsets: list[int]  # each row's top, mosaic pixels
    band: int
    gap: int
    mosaic_h: int
    mosaic_w: int
    margin_left: float
    margin_bottom: float
    width: float
    height: float
    wrapped: list[str]  # the title's lines
    title_band: float

    @property
    def by_key(self) -> dict[tuple[int, int, int | None], MapView]:
        return {(v.sentence, v.layer, v.head): v for v in self.views}

    def first(self, key: tuple[int, int]) -> MapView:
        return next(v for v in self.views if (v.sentence, v.layer) == key)

    def centre(self, offset: int, cell: int, cells: int) -> float:
        return offset + (cell + 0.5) * self.pixels / cells - 0.5

    @staticmethod
    def lay_out(views: list[MapView], title: str, size: float | None, dpi: int) -> Grid:
        import textwrap

        from attnviz.compute.display.views import downsample

        side = panel_inches(views, size)
        rows_keys = list(dict.fromkeys((v.sentence, v.layer) for v in views))
        heads = list(dict.fromkeys(v.head for v in views))
        n_rows, n_cols = len(rows_keys), len(heads)
        sentences = len(dict.fromkeys(sentence for sentence, _ in rows_keys))
        # The tiled image's resolution: the output's pixels, unless the image would be huge.
        rows_inches = n_rows * (side + PANEL_TITLE_BAND) + sentences * 1.0
        cols_inches = n_cols * (side + PANEL_GAP)
        ppi = min(float(dpi), (MAX_MOSAIC_PIXELS / (rows_inches * cols_inches)) ** 0.5)
        pixels = max(1, round(side * ppi))
        views = [downsample(v, pixels, pixels) for v in views]
        first = {key: next(v for v in views if (v.sentence, v.layer) == key) for key in rows_keys}
        ticks = {key: (axis_labels(view.row_labels, view.row_spans, side),
                       axis_labels(view.col_labels, view.col_spans, side))
                 for key, view in first.items()}
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
        return Grid(views, rows_keys, heads, sentences, side, ppi, pixels, ticks, labelled,
                     offsets, band, gap, mosaic_h, mosaic_w, margin_left, margin_bottom, width,
                     height, wrapped, title_band)


def _mosaic(grid: Grid, shown: Scale) -> NDArray[np.float32]:
    """Every panel stretched to its square and tiled (NaN between them: drawn white); masked
    cells below the colour scale, so they take its "under" colour."""
    import numpy as np

    masked = shown.vmin / 10 if shown.log else shown.vmin - 1.0
    mosaic = np.full((grid.mosaic_h, grid.mosaic_w), np.nan, dtype=np.float32)
    by_key = grid.by_key
    for r, (sentence, layer) in enumerate(grid.rows_keys):
        for c, head in enumerate(grid.heads):
            view = by_key.get((sentence, layer, head))
            if view is None:
                continue
            block = _stretch(view.values, grid.pixels)
            block = np.where(block == 0.0, masked,
                             np.maximum(block, shown.vmin) if shown.log else block)
            x = c * (grid.pixels + grid.gap)
            mosaic[grid.offsets[r] : grid.offsets[r] + grid.pixels, x : x + grid.pixels] = block
    return mosaic


def _axis_ticks(ax: Axes, grid: Grid) -> None:
    """Query labels beside every row of panels; the bottom row's key labels under every head."""
    y_pos, y_text = [], []
    for r, key in enumerate(grid.rows_keys):
        cells = grid.first(key).values.shape[0]
        for i, text in grid.ticks[key][0]:
            y_pos.append(grid.centre(grid.offsets[r], i, cells))
            y_text.append(text)
    ax.set_yticks(y_pos, y_text)
    last = grid.rows_keys[-1]
    x_pos, x_text = [], []
    cells = grid.first(last).values.shape[1]
    # Every token fits: each panel names its keys. Else (index ticks of a long input) only the
    # first panel does, as for the rows above: every head of a row has the same keys, and tick
    # labels are most of a long map's drawing time.
    labelled = len(grid.heads) if len(grid.ticks[last][1]) == cells else 1
    for c in range(labelled):
        for i, text in grid.ticks[last][1]:
            x_pos.append(grid.centre(c * (grid.pixels + grid.gap), i, cells))
            x_text.append(text)
    ax.set_xticks(x_pos, x_text, rotation=90)


def _row_labels(ax: Axes, grid: Grid) -> None:
    """Key labels under the rows that need them, and a title above every panel."""
    by_key = grid.by_key
    for r, key in enumerate(grid.rows_keys):
        if grid.labelled[r]:
            # Every head of a row has the same keys: label them under its first panel only
            # (text is most of a big grid's drawing time); the bottom row labels all.
            cells = grid.first(key).values.shape[1]
            for i, text in grid.ticks[key][1]:
                ax.text(grid.centre(0, i, cells), grid.offsets[r] + grid.pixels + 0.1 * grid.ppi,
                        text, fontsize=TEXT_PT, rotation=90, ha="center", va="top")
        for c, head in enumerate(grid.heads):
            view = by_key.get((key[0], key[1], head))
            if view is not None:
                ax.text(c * (grid.pixels + grid.gap) - 0.5, grid.offsets[r] - 0.04 * grid.ppi,
                        _panel_title(view, grid.sentences, grid.side), fontsize=TEXT_PT,
                        va="bottom", ha="left")


def _colour_bar(fig: Figure, image: AxesImage, grid: Grid,
                legend: str = "attention weight") -> None:
    """The colour bar beside the panels (at most 4 in tall), the masked-cell key under it."""
    from matplotlib.patches import Rectangle

    width, height = grid.width, grid.height
    bar_height = min(grid.mosaic_h / grid.ppi, 4.0)
    bar_top = grid.margin_bottom + grid.mosaic_h / grid.ppi
    bar_left = grid.margin_left + grid.mosaic_w / grid.ppi + 0.25
    bar = fig.add_axes((bar_left / width, (bar_top - bar_height) / height, 0.15 / width,
                        bar_height / height))
    fig.colorbar(image, cax=bar, label=legend)
    bar.tick_params(labelsize=TEXT_PT)
    if any((v.values == 0.0).any() for v in grid.views):
        key_top = bar_top - bar_height - 0.35
        fig.patches.append(Rectangle((bar_left / width, key_top / height), 0.15 / width,
                                     0.15 / height, transform=fig.transFigure,
                                     facecolor=MASKED_COLOR, edgecolor="none"))
        fig.text((bar_left + 0.22) / width, (key_top + 0.075) / height, "masked",
                 fontsize=TEXT_PT, va="center")
