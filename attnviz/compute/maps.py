"""Display-ready attention maps: real tokens only, selected heads, downsampled to fit.

Downsampling keeps the meaning of a row: key blocks are summed (the attention mass a query gives
to that span of keys) and query blocks averaged, so every displayed row still sums to 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

# MapView lives with the results that hold it (LayerAttention.views); imported from here too
from attnviz.compute.results import AttentionRun, LayerAttention, MapView
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

# A streamed layer keeps display views of its first heads only (a figure holds at most
# --max-panels, 256 by default, and the terminal fewer), so a layer of 40,000 heads keeps
# O(256 · B · c²), not O(H · B · c²); every head still enters the statistics and the mean.
MAX_VIEW_HEADS = 256


def check_head(head: int | None, num_heads: int) -> None:
    if head is not None and not 0 <= head < num_heads:
        raise UsageError(f"head {head} is out of range", fix=f"choose 0..{num_heads - 1}",
                         option="head")


def select_maps(run: AttentionRun, head: int | None, average: bool) -> list[MapView]:
    """One view per (sentence, layer, head) in that order; padding cut away."""
    import torch

    views = []
    for b in range(len(run.batch.tokens)):
        for captured in run.layers:
            if captured.weights is None:  # streamed: display-sized views were kept instead
                _check_kept(captured, head, average)
                views += [v for v in captured.views or [] if v.sentence == b and (
                    v.head is None if average else
                    v.head is not None and (head is None or v.head == head))]
                continue
            rows, cols = captured.rows_of(run.batch)[b], captured.columns_of(run.batch)[b]
            width = max(len(t) for t in captured.columns_of(run.batch))
            maps = captured.weights[b, :, :len(rows), :]  # (H, n, S)
            extra = maps.shape[-1] - width  # bias_k columns sit after the padding
            # real keys, then the bias_k columns: a view when there are none (no copy of H maps)
            maps = maps[:, :, :len(cols)] if extra == 0 else \
                torch.cat([maps[:, :, :len(cols)], maps[:, :, width:]], -1)
            col_labels = cols + ["<bias_k>"] * extra
            chosen: list[tuple[int | None, torch.Tensor]]
            if average:
                chosen = [(None, maps.mean(0))]
            elif head is not None:
                chosen = [(head, maps[head])]
            else:
                chosen = list(enumerate(maps))
            views += [MapView(b, captured.index, h, m.numpy(), list(rows), col_labels, False,
                              label=captured.label) for h, m in chosen]
    return views


def _check_kept(captured: LayerAttention, head: int | None, average: bool) -> None:
    """A streamed layer keeps display views of its first heads only (MAX_VIEW_HEADS)."""
    if head is not None and not average and head >= MAX_VIEW_HEADS:
        raise UsageError(f"a long input is streamed, and only the maps of heads "
                         f"0..{MAX_VIEW_HEADS - 1} are kept for display; head {head} is not",
                         fix=f"shorten the input, or pass {option('export')} FILE for every "
                             "full map",
                         option="head")


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
