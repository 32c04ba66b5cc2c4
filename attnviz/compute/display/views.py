"""Display views of attention maps, and how a map is cut into display cells: plain numpy, no
torch (a figure drawn in another process unpickles these without importing it).

Downsampling keeps the meaning of a row: key blocks are summed (the attention mass a query gives
to that span of keys) and query blocks averaged, so every displayed row still sums to 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray


@dataclass(frozen=True)
class MapView:
    sentence: int
    layer: int
    head: int | None  # None for the average over heads
    values: NDArray[np.float32]  # (rows, cols) numpy float32, rows = queries, cols = keys
    row_labels: list[str]
    col_labels: list[str]
    downsampled: bool
    # token index spans each displayed row/column covers, after downsampling (None: one each)
    row_spans: tuple[tuple[int, int], ...] | None = None
    col_spans: tuple[tuple[int, int], ...] | None = None
    tokens: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # original (rows, cols)
    label: str | None = None  # the layer's label when it is not its number ("enc 0", "cross 1")

    @property
    def title(self) -> str:
        head = "mean of heads" if self.head is None else f"head {self.head}"
        return f"{self.label if self.label is not None else f'L{self.layer}'} · {head}"


def downsample(view: MapView, max_rows: int, max_cols: int) -> MapView:
    rows, cols = view.values.shape
    grid = display_grid(rows, cols, max_rows, max_cols)
    if not grid.downsampled:
        return view
    averaged = _block_reduce(view.values, grid.row_blocks, grid.col_blocks)
    spanned = replace(view, row_spans=view.row_spans or _unit(rows),
                      col_spans=view.col_spans or _unit(cols))
    return replace(_blocked_view(spanned, averaged, grid), label=view.label)


@dataclass(frozen=True)
class DisplayGrid:
    """How a rows × cols map is cut into display cells: the query (row) and key (column) blocks
    `downsample` uses, so that maps reduced in pieces (`streaming.MapReducer`) come out equal."""

    row_blocks: list[tuple[int, int]]
    col_blocks: list[tuple[int, int]]
    downsampled: bool  # False: one cell per entry, and the view is the map itself

    def row_index(self) -> torch.Tensor:
        """For each row, the display row it falls in (an int64 tensor)."""
        return _block_index(self.row_blocks)

    def col_index(self) -> torch.Tensor:
        return _block_index(self.col_blocks)


def display_grid(rows: int, cols: int, max_rows: int, max_cols: int) -> DisplayGrid:
    if rows <= max_rows and cols <= max_cols:
        return DisplayGrid(_unit_blocks(rows), _unit_blocks(cols), False)
    return DisplayGrid(_blocks(rows, max_rows), _blocks(cols, max_cols), True)


def grid_view(grid: DisplayGrid, where: tuple[int, int, int | None],
              values: NDArray[np.float32], labels: tuple[list[str], list[str]]) -> MapView:
    """The view `downsample` makes of a map, from its already reduced values (one per cell:
    key blocks summed, query blocks averaged); where: (sentence, layer, head), labels: the full
    map's row and column labels."""
    sentence, layer, head = where
    row_labels, col_labels = labels
    if not grid.downsampled:
        return MapView(sentence, layer, head, values, list(row_labels), list(col_labels), False)
    full = MapView(sentence, layer, head, values, list(row_labels), list(col_labels), False,
                   _unit(len(row_labels)), _unit(len(col_labels)))
    return _blocked_view(full, values, grid)


def _blocked_view(view: MapView, values: NDArray[np.float32], grid: DisplayGrid) -> MapView:
    """view (its spans set) cut into the grid's cells, holding the reduced values."""
    assert view.row_spans is not None and view.col_spans is not None
    row_spans = _compose(view.row_spans, grid.row_blocks)
    col_spans = _compose(view.col_spans, grid.col_blocks)
    tokens = view.tokens or (tuple(view.row_labels), tuple(view.col_labels))
    return MapView(view.sentence, view.layer, view.head, values,
                   _span_labels(tokens[0], row_spans), _span_labels(tokens[1], col_spans), True,
                   row_spans, col_spans, tokens)


def _block_reduce(values: NDArray[np.float32], row_blocks: list[tuple[int, int]],
                  col_blocks: list[tuple[int, int]]) -> NDArray[np.float32]:
    """Key blocks summed, query blocks averaged: a (len(row_blocks), len(col_blocks)) float32
    numpy array.

    Query blocks first, each a sum of contiguous whole rows (one reshaped sum when the blocks
    are equal), then the key blocks with np.add.reduceat along the rows (contiguous): single-
    threaded numpy, exact per block, and no torch index_add_ along rows (slow on a CPU).
    """
    import numpy as np

    full = np.asarray(values, dtype=np.float32)
    edges = [a for a, _ in row_blocks] + [row_blocks[-1][1]]
    sizes = {b - a for a, b in row_blocks}
    if len(sizes) == 1 and edges[0] == 0 and edges[-1] == full.shape[0]:
        rows = full.reshape(len(row_blocks), sizes.pop(), full.shape[1]).sum(1)
    else:
        rows = np.empty((len(row_blocks), full.shape[1]), dtype=np.float32)
        for i, (a, b) in enumerate(row_blocks):
            np.sum(full[a:b], axis=0, out=rows[i])
    rows /= np.array([b - a for a, b in row_blocks], dtype=np.float32)[:, None]
    return np.add.reduceat(rows, [a for a, _ in col_blocks], axis=1).astype(np.float32)


def _block_index(blocks: list[tuple[int, int]]) -> torch.Tensor:
    """For each position, the index of the block it falls in."""
    import torch

    sizes = torch.tensor([b - a for a, b in blocks])
    return torch.repeat_interleave(torch.arange(len(blocks)), sizes)


def _unit(n: int) -> tuple[tuple[int, int], ...]:
    return tuple((i, i + 1) for i in range(n))


def _unit_blocks(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n)]


def _compose(spans: tuple[tuple[int, int], ...], blocks: list[tuple[int, int]]
             ) -> tuple[tuple[int, int], ...]:
    """Token spans of blocks of already-spanned rows."""
    return tuple((spans[a][0], spans[b - 1][1]) for a, b in blocks)


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(n, parts))
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


def _span_labels(labels: tuple[str, ...], spans: tuple[tuple[int, int], ...]) -> list[str]:
    return [labels[a] if b - a == 1 else f"{a}-{b - 1}" for a, b in spans]
