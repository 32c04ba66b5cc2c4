"""A block of query rows reduced to display cells: what `views.downsample` does to a full map
(key blocks summed; query blocks summed here, and divided by their query count when the map is
finished), for every head of the block at once.

On a CPU the sums run in numpy (single-threaded: no parallel region per block, which costs
most when other processes share the cores), as contiguous row ranges and `np.add.reduceat`
over the columns; elsewhere through torch's index_add_.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnviz.compute.display.views import DisplayGrid

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

# per real key count: the reduceat starts, and the display columns they fill
ColumnPlans = dict[int, tuple["NDArray[np.intp]", "slice | torch.Tensor"]]


@dataclass(frozen=True)
class BlockSpan:
    """Where a block of query rows lies: rows row_start.. of a sentence of n tokens, against
    its first `keys` real keys (then the extras), filling display rows low..high."""

    row_start: int
    keys: int
    n: int
    low: int
    high: int


def cell_sums(grid: DisplayGrid, index: tuple[torch.Tensor, torch.Tensor], attn: torch.Tensor,
              span: BlockSpan, plans: ColumnPlans) -> tuple[torch.Tensor, slice | torch.Tensor]:
    """(sums (heads, high - low + 1, C'), the display columns C' they fill) for attn (heads, r,
    keys + extra) lying at `span`; index: each query's display row and each key's display
    column (real keys, then the extras), on attn's device."""
    if attn.device.type != "cpu":
        return _device_sums(grid, index, attn, span), slice(None)
    row_start, keys, n, low, high = span.row_start, span.keys, span.n, span.low, span.high
    import numpy as np

    values = attn.detach().numpy()
    rows = _row_sums(grid, values, row_start, low, high)
    if keys not in plans:
        plans[keys] = _column_plan(grid, keys, n)
    starts, columns = plans[keys]
    return torch.from_numpy(np.add.reduceat(rows, starts, axis=2)), columns


def _row_sums(grid: DisplayGrid, values: NDArray[np.float32], row_start: int, low: int,
              high: int) -> NDArray[np.float32]:
    """(heads, high - low + 1, width): each display row's queries of the block summed."""
    import numpy as np

    heads, r, width = values.shape
    count = high - low + 1
    if count == r:  # one query per display row: the rows themselves
        return values
    edges = [max(a, row_start) - row_start for a, _ in grid.row_blocks[low:high + 1]] + [r]
    sizes = {b - a for a, b in zip(edges, edges[1:], strict=False)}
    if len(sizes) == 1:  # equal display rows: one reshaped sum
        return values.reshape(heads, count, r // count, width).sum(2)
    out = np.empty((heads, count, width), dtype=np.float32)
    for i in range(count):
        np.sum(values[:, edges[i]:edges[i + 1]], axis=1, out=out[:, i])
    return out


def _column_plan(grid: DisplayGrid, keys: int, n: int
                 ) -> tuple[NDArray[np.intp], slice | torch.Tensor]:
    """The block's columns are the real keys 0..keys, then the extras (bias_k): where each
    display column starts among them, and which display columns are not empty."""
    import numpy as np

    def at(x: int) -> int:
        return min(x, keys) + max(0, x - n)

    spans = [(at(a), at(b)) for a, b in grid.col_blocks]
    used = [c for c, (a, b) in enumerate(spans) if a < b]
    columns: slice | torch.Tensor = slice(None) if len(used) == len(spans) else \
        torch.tensor(used)
    return np.array([spans[c][0] for c in used], dtype=np.intp), columns


def _device_sums(grid: DisplayGrid, index: tuple[torch.Tensor, torch.Tensor],
                 attn: torch.Tensor, span: BlockSpan) -> torch.Tensor:
    row_index, col_index = index
    row_start, keys, n, low, high = span.row_start, span.keys, span.n, span.low, span.high
    heads, r, _ = attn.shape
    if high - low + 1 == r:
        summed = attn
    else:  # each row added into its display row: one pass over the block
        summed = torch.zeros(heads, high - low + 1, attn.shape[2], device=attn.device)
        summed.index_add_(1, row_index[row_start:row_start + r] - low, attn)
    columns = col_index if keys == n else torch.cat([col_index[:keys], col_index[n:]])
    cells = torch.zeros(heads, high - low + 1, len(grid.col_blocks), device=attn.device)
    return cells.index_add_(2, columns, summed)
