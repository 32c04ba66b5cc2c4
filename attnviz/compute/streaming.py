"""Long inputs in bounded memory: attention computed in blocks of query rows, each block
reduced at once to display-sized maps, summable statistics and the --query row, so that no
head's full L × S map ever exists.

Each block is exact: softmax is per row, and a block's rows see their full key range, so each
row's max and normalizer come from the whole row. Memory: O(rows · S) for one block of one head
and sentence (the block's rows follow a memory budget), plus O(B · H · c²) for the c × c display
maps and O(L) per head for the statistics' row terms, against O(B · H · L · S) for the full maps.
Time: the same O(H · B · L · S · d) work as the full maps, through matmuls into preallocated
buffers and in-place elementwise passes.

`MapReducer.add_rows` takes blocks of query rows from any producer: the kernel's block form for
standalone layers (`attnviz.compute.layer_stream`), and (through `add`, whole maps) Hugging Face
models' own eager maps (`attnviz.sources.hf`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from attnviz.compute.inputs import Batch
from attnviz.compute.maps import MAX_VIEW_HEADS, DisplayGrid, MapView, display_grid, grid_view
from attnviz.compute.results import LayerAttention
from attnviz.compute.row_stats import ROW_TERMS, SentencePatterns, row_terms, sentence_patterns
from attnviz.compute.stats import StatSums, add_sums, finish_stats
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckFailed

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

MAP_BUDGET_BYTES = 256 * 2**20  # default memory budget: beyond it, maps stream in blocks
DISPLAY_CELLS = 512  # the largest map a figure panel or terminal view needs
STREAMED = "blocks of query rows of one head and sentence at a time"
# A block holds its scores, its weights and the temporaries of one elementwise pass over it:
# about this many float32 copies of its rows.
BLOCK_BUFFERS = 3
# On a CPU, blocks beyond this many entries (or rows) stop paying: its passes fall out of
# cache, and the r × r keys beside a block grow, while the fixed cost of a block is already
# < 2 % of its work. GPUs take what the budget allows.
CPU_BLOCK_ENTRIES = 2**22
CPU_BLOCK_ROWS = 256
MAX_BLOCK_ROWS = 2048  # GPUs: the r × r keys beside a block stay small


def full_maps_bytes(batch: Batch, num_heads: int, extra_keys: int = 0, layers: int = 1) -> int:
    return layers * len(batch.tokens) * num_heads * batch.max_len * (batch.max_len + extra_keys) * 4


def streams(batch: Batch, num_heads: int, extra_keys: int = 0,
            budget: int | None = None) -> bool:
    """Whether a layer's full maps exceed the memory budget, so that they stream in blocks."""
    limit = MAP_BUDGET_BYTES if budget is None else budget
    return full_maps_bytes(batch, num_heads, extra_keys) > limit


def block_rows(budget: int | None, keys: int, device: torch.device) -> int:
    """Query rows per block: as many as the budget holds, capped (see CPU_BLOCK_ENTRIES)."""
    limit = MAP_BUDGET_BYTES if budget is None else budget
    rows = limit // (BLOCK_BUFFERS * 4 * max(1, keys))
    cap = min(CPU_BLOCK_ROWS, CPU_BLOCK_ENTRIES // max(1, keys)) if device.type == "cpu" \
        else MAX_BLOCK_ROWS
    return max(1, min(rows, cap))


@dataclass
class _Partial:
    """One (sentence, head) map while its row blocks arrive."""

    grid: DisplayGrid
    rows_cpu: list[int]  # the display row of each query (host ints)
    row_index: torch.Tensor  # the same, on the device
    col_index: torch.Tensor  # the display column of each key (real keys, then extra columns)
    cells: torch.Tensor  # (R, C) Σ over each display row's queries of their key-block sums
    terms: torch.Tensor  # (len(ROW_TERMS), n) each query's term of every statistic
    done: int = 0
    covered: list[tuple[int, int]] = field(default_factory=list)
    # per key count: reduceat starts, and the display columns they fill
    col_plan: dict[int, tuple[list[int], slice | NDArray[np.intp]]] = field(default_factory=dict)


class MapReducer:
    """One layer's display views (per sentence and head, plus each sentence's mean over heads),
    summable head statistics and, for --query, one query's row of every head; fed blocks of
    query rows (`add_rows`) or whole maps (`add`), none of which it keeps.

    Work stays on the device the blocks come from; only finished display maps, statistics and
    the query row move to the CPU.
    """

    def __init__(self, layer_index: int, tokens: list[list[str]],
                 query_row: tuple[int, int] | None = None,
                 extra_keys: int | None = None) -> None:
        self.layer_index = layer_index
        self.tokens = tokens
        self.query_row = query_row  # (sentence, query)
        self.extra_keys = extra_keys  # columns after the real keys (bias_k); None: from `add`
        self.views: list[MapView] = []
        self._sums: dict[int, StatSums] = {}  # per head, over the sentences seen
        self._mean: dict[int, tuple[torch.Tensor, int]] = {}  # per sentence: Σ views, heads
        self._rows: dict[int, torch.Tensor] = {}  # per head: the query's row (S,)
        self._open: dict[tuple[int, int], _Partial] = {}
        self._patterns: dict[tuple[int, str], SentencePatterns] = {}
        self._non_finite = False

    def add(self, sentence: int, first_head: int, attn: torch.Tensor,
            scores: torch.Tensor | None = None) -> None:
        """attn (heads, n, S): the sentence's n real queries against its real keys (then any
        bias_k column); scores, when given, the pre-softmax scores it came from."""
        if self.extra_keys is None:
            self.extra_keys = attn.shape[-1] - len(self.tokens[sentence])
        step = block_rows(None, attn.shape[-1], attn.device)  # bounded temporaries, as streamed
        for start in range(0, attn.shape[1], step):
            stop = start + step
            self.add_rows(sentence, first_head, start, attn[:, start:stop],
                          None if scores is None else scores[:, start:stop])

    def add_rows(self, sentence: int, first_head: int, row_start: int, attn: torch.Tensor,
                 scores: torch.Tensor | None = None) -> None:
        """One block of query rows of heads first_head.. of a sentence, reduced at once.

        attn (heads, r, K + extra) float32: the weights of queries row_start .. row_start + r
        (real tokens) against the sentence's first K real keys, then its `extra_keys` columns
        (bias_k). K may stop short of the sentence's length n when every later key has weight
        0 (a causal block), but must reach past the block's last query. scores (same shape),
        optional: the pre-softmax scores (finite; where a mask zeroed a weight, any finite
        value), which spare the entropy a logarithm per entry.
        """
        tokens = self.tokens[sentence]
        n = len(tokens)
        if self.extra_keys is None:
            self.extra_keys = 0
        heads, r, width = attn.shape
        keys = width - self.extra_keys
        if not (min(row_start + r, n) <= keys <= n and row_start + r <= n and r > 0):
            raise ValueError(f"a block of rows {row_start}:{row_start + r} with {keys} real keys "
                             f"does not fit a sentence of {n} tokens")
        patterns = self._sentence_patterns(sentence, attn.device)
        terms = row_terms(attn, row_start, keys, patterns, scores)
        for j in range(heads):
            head = first_head + j
            part = self._open.get((sentence, head)) or self._start(sentence, head, attn.device)
            stop = row_start + r
            part.terms[:, row_start:stop] = terms[:, j]
            self._add_cells(part, attn[j], row_start, keys, n)
            part.done += r
            part.covered.append((row_start, stop))
            if self.query_row is not None and self.query_row[0] == sentence and \
                    row_start <= self.query_row[1] < stop:
                row = torch.zeros(n + self.extra_keys)
                picked = attn[j, self.query_row[1] - row_start].float().cpu()
                row[:keys] = picked[:keys]
                row[n:] = picked[keys:]
                self._rows[head] = row
            if part.done >= n:
                self._finish_map(sentence, head, part)

    def _sentence_patterns(self, sentence: int, device: torch.device) -> SentencePatterns:
        key = (sentence, str(device))
        if key not in self._patterns:
            self._patterns[key] = sentence_patterns(tuple(self.tokens[sentence])).to(device)
        return self._patterns[key]

    def _start(self, sentence: int, head: int, device: torch.device) -> _Partial:
        n = len(self.tokens[sentence])
        grid = display_grid(n, n + (self.extra_keys or 0), DISPLAY_CELLS, DISPLAY_CELLS)
        row_index = grid.row_index()
        part = _Partial(grid, row_index.tolist(), row_index.to(device),
                        grid.col_index().to(device),
                        torch.zeros(len(grid.row_blocks), len(grid.col_blocks), device=device),
                        torch.zeros(len(ROW_TERMS), n, device=device))
        self._open[(sentence, head)] = part
        return part

    @staticmethod
    def _add_cells(part: _Partial, attn: torch.Tensor, row_start: int, keys: int,
                   n: int) -> None:
        """Key blocks summed and the block's rows summed into their display rows (divided by
        each display row's query count when the map is finished): what `downsample` does."""
        r = attn.shape[0]
        low, high = part.rows_cpu[row_start], part.rows_cpu[row_start + r - 1]
        if attn.device.type == "cpu":  # numpy segment sums: no parallel region per block
            _add_cells_host(part, attn.detach().numpy(), row_start, keys, n, low, high)
            return
        if high - low + 1 == r:  # one query per display row: the rows themselves
            summed = attn
        else:  # each row added into its display row: one pass over the block
            summed = torch.zeros(high - low + 1, attn.shape[1], device=attn.device)
            summed.index_add_(0, part.row_index[row_start:row_start + r] - low, attn)
        columns = part.col_index if keys == n else \
            torch.cat([part.col_index[:keys], part.col_index[n:]])
        part.cells[low:high + 1].index_add_(1, columns, summed)

    def _finish_map(self, sentence: int, head: int, part: _Partial) -> None:
        del self._open[(sentence, head)]
        tokens = self.tokens[sentence]
        n = len(tokens)
        covered = sorted(part.covered)
        if covered[0][0] != 0 or covered[-1][1] != n or part.done != n or \
                any(a[1] != b[0] for a, b in itertools.pairwise(covered)):
            raise ValueError(f"the row blocks of sentence {sentence}, head {head} do not cover "
                             f"its {n} queries once")
        terms = part.terms.cpu().double()
        if not bool(torch.isfinite(terms[ROW_TERMS.index("total")]).all()):
            self._non_finite = True
        counts = self._patterns[(sentence, str(part.cells.device))].counts
        sums = {name: terms[i].sum().reshape(1) for i, name in enumerate(ROW_TERMS)
                if name != "total"}
        self._sums[head] = add_sums(self._sums.get(head),
                                    (sums, {name: counts[name] for name in sums}))
        sizes = torch.tensor([b - a for a, b in part.grid.row_blocks], dtype=torch.float32)
        values = (part.cells.cpu() / sizes[:, None]).numpy().copy()
        labels = tokens + ["<bias_k>"] * (self.extra_keys or 0)
        view = grid_view(part.grid, sentence, self.layer_index, head, values, tokens, labels)
        if head < MAX_VIEW_HEADS:  # tens of thousands of heads: display views stay bounded
            self.views.append(view)
        total, heads = self._mean.get(sentence, (0, 0))
        self._mean[sentence] = (total + torch.from_numpy(values), heads + 1)

    def finish(self, layer: AttentionLayer, inputs: torch.Tensor | None,
               method: str) -> LayerAttention:
        if self._open:
            sentence, head = next(iter(self._open))
            raise ValueError(f"sentence {sentence}, head {head} is missing query rows")
        if self._non_finite:
            raise CheckFailed(f"layer {self.layer_index} produced non-finite attention weights",
                              fix="check the weights with 'attnviz inspect ‹scan›'")
        first_view: dict[int, MapView] = {}
        for view in self.views:
            first_view.setdefault(view.sentence, view)
        means = [replace(first_view[b], head=None, values=(total / heads).numpy())
                 for b, (total, heads) in sorted(self._mean.items())]
        stats = [s for head in sorted(self._sums)
                 for s in finish_stats(self._sums[head], self.layer_index, first_head=head)]
        rows = torch.stack([self._rows[h] for h in sorted(self._rows)]) if self._rows else None
        return LayerAttention(self.layer_index, layer, None, inputs, method,
                              views=self.views + means, stats=stats,
                              query_row=self.query_row if rows is not None else None,
                              query_weights=rows)


def _add_cells_host(part: _Partial, attn: NDArray[np.float32], row_start: int, keys: int,
                    n: int, low: int, high: int) -> None:
    """_add_cells on the CPU: np.add.reduceat over the block's rows, then its columns (each
    display cell a contiguous range of both), into the display cells."""
    import numpy as np

    r = attn.shape[0]
    if high - low + 1 < r:
        edges = [max(a, row_start) - row_start for a, _ in part.grid.row_blocks[low:high + 1]]
        if len(edges) <= 8:  # a few display rows: numpy sums of contiguous rows
            attn = np.stack([attn[a:b].sum(0) for a, b in zip(edges, [*edges[1:], r],
                                                               strict=True)])
        else:  # many (np.add.reduceat along rows is slow): one index_add pass
            summed = torch.from_numpy(np.zeros((len(edges), attn.shape[1]), np.float32))
            attn = summed.index_add_(0, part.row_index[row_start:row_start + r] - low,
                                     torch.from_numpy(attn)).numpy()
    if keys not in part.col_plan:  # the block's columns: real keys 0..keys, then the extras
        def at(x: int) -> int:
            return min(x, keys) + max(0, x - n)

        spans = [(at(a), at(b)) for a, b in part.grid.col_blocks]
        used = [c for c, (a, b) in enumerate(spans) if a < b]
        part.col_plan[keys] = ([spans[c][0] for c in used],
                               slice(None) if len(used) == len(spans) else np.array(used))
    starts, cells = part.col_plan[keys]
    part.cells.numpy()[low:high + 1, cells] += np.add.reduceat(attn, starts, axis=1)
