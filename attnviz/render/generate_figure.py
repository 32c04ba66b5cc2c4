"""`attnviz generate --out`: the usual figure with the prompt/generated boundary marked on every
panel that shows generated tokens: a line above the first generated token's row (and, where the
keys are the same tokens, left of its column)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.render.figure import MASKED_COLOR, TEXT_PT, Grid, heatmap_figure
from attnviz.render.figure_io import FIGURE_DPI, isolated
from attnviz.render.figure_io import label as safe

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.compute.display.views import MapView
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.sources.generate_spec import Generation

BOUNDARY_COLOR = "#ff2d2d"


def run_figure(views: list[MapView], title: str, look: tuple[str, float | None, int | None],
               legend: str, marks: tuple[AttentionRun, Generation | None]) -> Figure:
    """`heatmap_figure` of the views (look: scale, size, dpi), with the prompt/generated
    boundary and the cross strip marked when marks' generation is not None (--generate)."""
    scale, size, dpi = look
    figure = heatmap_figure(views, title, scale, size, dpi, legend)
    run, generation = marks
    if generation is not None:
        mark_generation(figure, views, title, run, generation, (size, dpi))
    return figure


def mark_generation(fig: Figure, views: list[MapView], title: str, run: AttentionRun,
                    generation: Generation, layout: tuple[float | None, int | None] = (None, None)
                    ) -> tuple[int, int]:
    """The boundary on every panel that shows generated tokens, and for an encoder-decoder the
    cross strip beside the maps (for the one head every view shows, else the mean over
    heads); returns (lines, strips) drawn. layout: the figure's (size, dpi)."""
    heads = {view.head for view in views}
    head = next(iter(heads)) if len(heads) == 1 else None
    lines = mark_boundary(fig, views, title, run, generation, layout)
    return lines, add_cross_strip(fig, run, generation, head)


@isolated
def mark_boundary(fig: Figure, views: list[MapView], title: str, run: AttentionRun,
                  generation: Generation, layout: tuple[float | None, int | None] = (None, None)
                  ) -> int:
    """Draw the boundary on `fig` (made by `heatmap_figure` from the same views, title and
    layout (size, dpi)); returns how many lines were drawn."""
    size, dpi = layout
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


STRIP_CELL = 0.3  # inches per cell of the cross strip at most
STRIP_TOP = 0.9  # inches above the first strip (the figure's title band)
STRIP_GAP = 0.9  # inches between two sentences' strips (a title, the source's labels)


@isolated
def add_cross_strip(fig: Figure, run: AttentionRun, generation: Generation,
                    head: int | None = None) -> int:
    """An encoder-decoder's alignment as it was produced, beside the full maps: per sentence a
    strip of its generated tokens (rows, each its row when fed back in) × the source's tokens,
    from the last cross layer with full maps, for `head` or the mean over heads. The figure
    grows to the right (the maps keep their size); returns how many strips were drawn."""
    import matplotlib

    from attnviz.render.figure_io import check_canvas

    layer = next((c for c in reversed(run.layers) if c.kind == "cross" and c.weights is not None),
                 None)
    if layer is None or layer.weights is None or not any(generation.generated_ids):
        return 0
    keys = layer.columns_of(run.batch)
    counts = [len(ids) for ids in generation.generated_ids]
    width, height = (float(v) for v in fig.get_size_inches())
    room = height - STRIP_TOP - STRIP_GAP * len(counts)
    cell = max(0.02, min(STRIP_CELL, room / max(1, sum(counts)),
                         8.0 / max(len(k) for k in keys)))
    strip = 1.4 + max(cell * max(len(k) for k in keys), 2.8) + 0.4  # labels, cells, margin
    total = width + strip
    check_canvas(total, height, float(fig.dpi))
    _widen(fig, width, total)
    cmap = matplotlib.colormaps["viridis"].with_extremes(under=MASKED_COLOR)
    top = height - STRIP_TOP
    drawn = 0
    for b, count in enumerate(counts):
        if count == 0:
            continue
        first, n = generation.prompt_lengths[b], len(keys[b])
        maps = layer.weights[b, :, first:first + count, :n]  # (H, T, S)
        values = (maps.mean(0) if head is None else maps[head]).numpy()
        ax = fig.add_axes(((width + 1.4) / total, (top - count * cell) / height,
                           n * cell / total, count * cell / height))
        ax.imshow(values, cmap=cmap, vmin=1e-30, vmax=max(float(values.max()), 1e-30),
                  interpolation="nearest", aspect="auto")
        every = max(1, round(0.12 / cell))
        ax.set_yticks(range(0, count, every),
                      [safe(t) for t in generation.generated_tokens[b][::every]], parse_math=False)
        ax.set_xticks(range(0, n, every), [safe(t) for t in keys[b][::every]], rotation=90,
                      parse_math=False)
        ax.tick_params(length=0, labelsize=TEXT_PT)
        who = "mean over heads" if head is None else f"head {head}"
        ax.set_title(safe(f"sentence {b + 1} · {layer.label} · {who}"),
                     fontsize=TEXT_PT + 1, loc="left", parse_math=False)
        ax.set_ylabel("generated (own scale)", fontsize=TEXT_PT)
        top -= count * cell + STRIP_GAP
        drawn += 1
    return drawn


def _widen(fig: Figure, width: float, total: float) -> None:
    """The figure `total` inches wide, everything on it where it was (in inches)."""
    from matplotlib.patches import Rectangle

    ratio = width / total
    fig.set_size_inches(total, fig.get_size_inches()[1])
    for ax in fig.axes:
        box = ax.get_position()
        ax.set_position((box.x0 * ratio, box.y0, box.width * ratio, box.height))
    for text in fig.texts:
        x, y = text.get_position()
        text.set_position((x * ratio, y))
    for patch in fig.patches:
        if isinstance(patch, Rectangle):
            patch.set_x(patch.get_x() * ratio)
            patch.set_width(patch.get_width() * ratio)
