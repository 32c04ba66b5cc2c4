"""`attnviz compare --out`: each head's weight distance ‖B − A‖ / ‖A‖ as a layers × heads
heatmap (byte-identical heads marked with =), and with a corpus each statistic's difference
B − A per head (layer by layer) with its 95 % interval over examples as error bars."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.errors import elide_at_boundaries
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from attnviz.compute.comparison.compare_result import CompareResult, CorpusComparison
    from attnviz.compute.comparison.head_weights import WeightComparison

COLUMNS = 4
MAX_LABELLED = 32  # heads or layers beyond which tick labels and = marks are left out


@isolated
def compare_figure(result: CompareResult) -> Figure:
    corpus = result.corpus
    panels = 1 + (len(corpus.statistics) if corpus is not None else 0)
    columns = min(COLUMNS, panels)
    rows = -(-panels // columns)
    fig = new_figure(4.2 * columns, 3.0 * rows + 0.5)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    _weights_panel(fig, axes[0], result.weights)
    if corpus is not None:
        for s, name in enumerate(corpus.statistics):
            _difference_panel(axes[1 + s], corpus, s, name)
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.suptitle(label(elide_at_boundaries(
        f"{result.source_b} against {result.source_a}" + (
            f" over {corpus.counts.used} examples" if corpus is not None else ""), 200)),
        fontsize=10, parse_math=False)
    return fig


def _weights_panel(fig: Figure, ax: Axes, weights: WeightComparison) -> None:
    import numpy as np

    heads = max((len(layer.heads) for layer in weights.layers), default=0)
    grid = np.full((len(weights.layers), max(heads, 1)), np.nan)
    for i, layer in enumerate(weights.layers):
        for h in layer.heads:
            grid[i, h.head] = h.distance if np.isfinite(h.distance) else np.nan
    image = ax.imshow(grid, cmap="magma", interpolation="nearest", aspect="auto", vmin=0)
    fig.colorbar(image, ax=ax, shrink=0.8)
    if len(weights.layers) <= MAX_LABELLED and heads <= MAX_LABELLED:
        for i, layer in enumerate(weights.layers):
            for h in layer.heads:
                if h.identical:
                    ax.text(h.head, i, "=", ha="center", va="center", color="white",
                            fontsize=8, parse_math=False)
    ax.set_title("weights: ‖B − A‖ / ‖A‖ per head (= identical)", fontsize=9,
                 parse_math=False)
    ax.set_xlabel("head", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.tick_params(labelsize=7)


def _difference_panel(ax: Axes, corpus: CorpusComparison, s: int, name: str) -> None:
    d = corpus.difference
    xs, diffs, errors = [], [], ([], [])  # type: ignore[var-annotated]
    bounds, x = [], 0
    for l, info in enumerate(corpus.layers):  # noqa: E741
        if l:
            bounds.append(x - 0.5)
        for h in range(info.heads):
            diff = float(d.diff[l, h, s])
            if diff == diff:
                low, high = float(d.low[l, h, s]), float(d.high[l, h, s])
                xs.append(x)
                diffs.append(diff)
                errors[0].append(diff - low if low == low else 0.0)
                errors[1].append(high - diff if high == high else 0.0)
            x += 1
    ax.errorbar(xs, diffs, yerr=[errors[0], errors[1]], fmt="o", markersize=2,
                elinewidth=0.8)
    ax.axhline(0, color="0.5", linewidth=0.6)
    for b in bounds:
        ax.axvline(b, color="0.85", linewidth=0.6)
    ax.set_title(f"{name}: B − A (95% interval)", fontsize=9, parse_math=False)
    ax.set_xlabel("head (layer by layer)", fontsize=8)
    ax.tick_params(labelsize=7)
