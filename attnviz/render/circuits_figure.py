"""The `circuits --out` figure: each layer's singular-value spectra (QK and OV, one line per
head) on top, and the K-, Q- and V-composition of every head on every earlier head below."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.compute.qkov.circuits_result import CircuitsResult
from attnviz.errors import elide_at_boundaries
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

MAX_SPECTRA = 8  # layers whose spectra are drawn (the first ones chosen)
MAX_GRID_HEADS = 512  # heads along each composition heatmap's side


@isolated
def circuits_figure(result: CircuitsResult) -> Figure:
    layers = result.layers[:MAX_SPECTRA]
    kinds = [k for k in ("K", "Q", "V") if result.grids(k)]
    columns = max(len(layers), len(kinds), 1)
    rows = 2 if kinds else 1
    fig = new_figure(3.6 * columns, 3.4 * rows + 0.6)
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, layer in zip(axes[0], layers, strict=False):
        for c in layer.heads:
            line = ax.semilogy(range(1, len(c.qk.singular_values) + 1),
                               [max(v, 1e-12) for v in c.qk.singular_values], linewidth=1,
                               label=f"h{c.head}")[0]
            ax.semilogy(range(1, len(c.ov.singular_values) + 1),
                        [max(v, 1e-12) for v in c.ov.singular_values], linewidth=1,
                        linestyle="--", color=line.get_color())
        ax.set_title(label(f"layer {layer.label}: σ of W_QK (—), W_OV (--)", 60), fontsize=9,
                     parse_math=False)
        ax.set_xlabel("index (one line per head)", fontsize=8)
        if len(layer.heads) <= 8:
            ax.legend(fontsize=7)
    for ax in axes[0][len(layers):]:
        ax.axis("off")
    if kinds:
        row_names, row_index = _head_axis(result, {g.later for g in result.compositions})
        col_names, col_index = _head_axis(result, {g.earlier for g in result.compositions})
        top = max(s for g in result.compositions for row in g.scores for s in row) or 1.0
        for ax, kind in zip(axes[1], kinds, strict=False):  # one colour scale for all three
            image = ax.imshow(_matrix(result, kind, row_index, col_index), cmap="viridis",
                              vmin=0, vmax=top, interpolation="nearest", aspect="auto")
            ax.set_title(f"{kind}-composition (later rows, earlier columns)", fontsize=9)
            if len(row_names) <= 24 and len(col_names) <= 24:
                ax.set_xticks(range(len(col_names)), [label(n, 12) for n in col_names], rotation=90,
                              fontsize=7)
                ax.set_yticks(range(len(row_names)), [label(n, 12) for n in row_names], fontsize=7)
            fig.colorbar(image, ax=ax, shrink=0.8)
        for ax in axes[1][len(kinds):]:
            ax.axis("off")
    fig.suptitle(label(elide_at_boundaries(f"circuits of {result.source}", 200)), fontsize=11,
                 parse_math=False)
    return fig


def _head_axis(result: CircuitsResult,
               used_layers: set[int]) -> tuple[list[str], dict[tuple[int, int], int]]:
    """Every head of `used_layers`, in order, as 'layer.head', and its position."""
    used = sorted(used_layers)
    names: list[str] = []
    index: dict[tuple[int, int], int] = {}
    for i in used:
        for h in range(result.layers[i].num_heads):
            if len(names) < MAX_GRID_HEADS:
                index[(i, h)] = len(names)
                names.append(f"{result.layers[i].label}.{h}")
    return names, index


def _matrix(result: CircuitsResult, kind: str, rows: dict[tuple[int, int], int],
            cols: dict[tuple[int, int], int]) -> np.ndarray:
    import numpy as np

    values = np.full((len(rows), len(cols)), np.nan)
    for g in result.grids(kind):
        for i, row in enumerate(g.scores):
            for j, score in enumerate(row):
                at = rows.get((g.later, i)), cols.get((g.earlier, j))
                if at[0] is not None and at[1] is not None:
                    values[at[0], at[1]] = score
    return values
