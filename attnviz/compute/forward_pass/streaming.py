"""Long inputs in bounded memory: attention computed in blocks of query rows, each block
reduced at once to display-sized maps, summable statistics and the --query row, so that no
head's full L × S map ever exists.

Each block is exact: softmax is per row, and a block's rows see their full key range, so each
row's max and normalizer come from the whole row. Memory: O(heads · rows · S) for one block of
one sentence (rows and heads follow the memory plan: `attnviz.core.memory`), plus O(B · H · c²)
for the c × c display maps and O(L) per head for the statistics' row terms, against
O(B · H · L · S) for the full maps.
Time: the same O(H · B · L · S · d) work as the full maps, through matmuls into preallocated
buffers and in-place elementwise passes.

`MapReducer.add_rows` takes blocks of query rows from any producer: the kernel's block form for
standalone layers (`attnviz.compute.forward_pass.layer_stream`), and (through `add`, whole maps)
Hugging Face
models' own eager maps (`attnviz.sources.hf`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from numpy.typing import NDArray

from attnviz.compute.display.cells import BlockSpan, ColumnPlans, cell_sums
from attnviz.compute.display.maps import MAX_VIEW_HEADS
from attnviz.compute.display.views import DisplayGrid, MapView, display_grid, grid_view
from attnviz.compute.forward_pass.results import StreamedMaps
from attnviz.compute.measures.row_stats import (
    NOT_STATISTICS,
    ROW_TERMS,
    SentencePatterns,
    row_terms,
    sentence_patterns,
    zeros,
)
from attnviz.compute.measures.stats import StatSums, add_sums, finish_stats
from attnviz.core import memory
from attnviz.errors import CheckFailed, option

DISPLAY_CELLS = 512  # the largest map a figure panel or terminal view needs
STREAMED = "blocks of query rows of one head and sentence at a time"


def _accumulate(cells: torch.Tensor, low: int, high: int, columns: slice | torch.Tensor,
                values: torch.Tensor) -> None:
    """cells[low..high, columns] += values; on a CPU in numpy (one thread: an add this size
    in torch opens a parallel region, and under load waits at its barrier)."""
    if cells.device.type != "cpu":
        cells[low:high + 1, columns] += values
        return
    where = columns if isinstance(columns, slice) else columns.numpy()
    cells.numpy()[low:high + 1, where] += values.numpy()


@dataclass
class _Partial:
    """One (sentence, head) map while its row blocks arrive."""

    grid: DisplayGrid
    rows_cpu: list[int]  # the display row of each query (host ints)
    row_index: torch.Tensor  # the same, on the device
    col_index: torch.Tensor  # the display column of each key (real keys, then extra columns)
    cells: torch.Tensor | None  # (R, C) Σ over each display row's queries of their key-block
    # sums (None: no display views kept)
    terms: torch.Tensor  # (len(ROW_TERMS), n) each query's term of every statistic
    done: int = 0
    covered: list[tuple[int, int]] = field(default_factory=list)


class MapReducer:
    """One layer's display views (per sentence and head, plus each sentence's mean over heads),
    summable head statistics and, for --query, one query's row of every head; fed blocks of
    query rows (`add_rows`) or whole maps (`add`), none of which it keeps.

    Work stays on the device the blocks come from; only finished display maps, statistics and
    the query row move to the CPU.
    """

    def __init__(self, layer_index: int, tokens: list[list[str]],
                 query_row: tuple[int, int] | None = None,
                 extra_keys: int | None = None, views: bool = True) -> None:
        """views: keep display views (False when no output shows a map: statistics alone,
        without the per-block cell sums and about 1 MB per head of views)."""
        self.layer_index = layer_index
        self.keep_views = views
        self.tokens = tokens
        self.query_row = query_row  # (sentence, query)
        self.extra_keys = extra_keys  # columns after the real keys (bias_k); None: from `add`
        self.views: list[MapView] = []
        self._sums: dict[int, StatSums] = {}  # per head, over the sentences seen
        self._mean: dict[int, tuple[NDArray[np.float32] | None, int]] = {}  # Σ views, heads
        self._rows: dict[int, torch.Tensor] = {}  # per head: the query's row (S,)
        self._open: dict[tuple[int, int], _Partial] = {}
        self._patterns: dict[tuple[int, str], SentencePatterns] = {}
        self._col_plans: dict[int, ColumnPlans] = {}  # per sentence: see `cell_sums`
        # the display layout of the latest sentence: grid, row index (host, device), col index
        self._layouts: dict[tuple[int, str], tuple[DisplayGrid, list[int], torch.Tensor,
                                                   torch.Tensor]] = {}
        self._template: MapView | None = None  # the latest sentence's view, for its labels
        self._non_finite = False
        # whether a block put weight on a real key after its query (weights ≥ 0, as a
        # softmax's: their sum over those keys is 0 only when each of them is)
        self.sees_later_keys = False

    def add(self, sentence: int, first_head: int, attn: torch.Tensor,
            scores: torch.Tensor | None = None) -> None:
        """attn (heads, n, S): the sentence's n real queries against its real keys (then any
        bias_k column); scores, when given, the pre-softmax scores it came from."""
        if self.extra_keys is None:
            self.extra_keys = attn.shape[-1] - len(self.tokens[sentence])
        # bounded temporaries, as streamed
        step = memory.block_rows(None, attn.shape[-1], attn.device.type == "cpu")
        for start in range(0, attn.shape[1], step):
            stop = start + step
            self.add_rows(sentence, first_head, start, attn[:, start:stop],
                          None if scores is None else scores[:, start:stop])

    def add_rows(self, sentence: int, first_head: int, row_start: int, attn: torch.Tensor,
                 scores: torch.Tensor | None = None,
                 score_max: torch.Tensor | None = None) -> None:
        """One block of query rows of heads first_head.. of a sentence, reduced at once.

        attn (heads, r, K + extra) float32: the weights of queries row_start .. row_start + r
        (real tokens) against the sentence's first K real keys, then its `extra_keys` columns
        (bias_k). K may stop short of the sentence's length n when every later key has weight
        0 (a causal block), but must reach past the block's last query. scores (same shape),
        optional: the pre-softmax scores (finite; where a mask zeroed a weight, any finite
        value), which spare the entropy a logarithm per entry. score_max (heads, r), optional
        with scores: each row's largest score over the keys it sees (the kernel's).
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
        terms = row_terms(attn, row_start, keys, patterns, scores, score_max)
        if not self.sees_later_keys:
            self.sees_later_keys = bool(terms[ROW_TERMS.index("later")].ne(0).any())
        parts = [self._open.get((sentence, first_head + j))
                 or self._start(sentence, first_head + j, attn.device) for j in range(heads)]
        stop = row_start + r
        low, high = parts[0].rows_cpu[row_start], parts[0].rows_cpu[stop - 1]
        first = parts[0]
        if self.keep_views:
            cells, columns = cell_sums(first.grid, (first.row_index, first.col_index), attn,
                                       BlockSpan(row_start, keys, n, low, high),
                                       self._col_plans.setdefault(sentence, {}))
        for j, part in enumerate(parts):
            head = first_head + j
            part.terms[:, row_start:stop] = terms[:, j]
            if part.cells is not None:
                _accumulate(part.cells, low, high, columns, cells[j])
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
        key = (sentence, str(device))
        if key not in self._layouts:  # every head of a sentence shares its display layout
            grid = display_grid(n, n + (self.extra_keys or 0), DISPLAY_CELLS, DISPLAY_CELLS)
            row_index = grid.row_index()
            self._layouts = {key: (grid, row_index.tolist(), row_index.to(device),
                                   grid.col_index().to(device))}  # one sentence at a time
        grid, rows_cpu, row_index, col_index = self._layouts[key]
        part = _Partial(grid, rows_cpu, row_index, col_index,
                        zeros((len(grid.row_blocks), len(grid.col_blocks)), device)
                        if self.keep_views else None,
                        zeros((len(ROW_TERMS), n), device))
        self._open[(sentence, head)] = part
        return part

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
        counts = self._patterns[(sentence, str(part.terms.device))].counts
        sums = {name: terms[i].sum().reshape(1) for i, name in enumerate(ROW_TERMS)
                if name not in NOT_STATISTICS}
        self._sums[head] = add_sums(self._sums.get(head),
                                    (sums, {name: counts[name] for name in sums}))
        if part.cells is None:
            return
        sizes = np.array([b - a for a, b in part.grid.row_blocks], dtype=np.float32)
        values: NDArray[np.float32] = np.divide(part.cells.cpu().numpy(), sizes[:, None],
                                                dtype=np.float32)  # new (numpy: one thread)
        template = self._template
        if template is None or template.sentence != sentence:  # its labels, once per sentence
            labels = tokens + ["<bias_k>"] * (self.extra_keys or 0)
            template = grid_view(part.grid, (sentence, self.layer_index, head), values,
                                 (tokens, labels))
            self._template = template
        view = replace(template, head=head, values=values)
        if head < MAX_VIEW_HEADS:  # tens of thousands of heads: display views stay bounded
            self.views.append(view)
        total, heads = self._mean.get(sentence, (None, 0))
        self._mean[sentence] = (values.copy() if total is None else total + values, heads + 1)

    def finish(self) -> StreamedMaps:
        if self._open:
            sentence, head = next(iter(self._open))
            raise ValueError(f"sentence {sentence}, head {head} is missing query rows")
        if self._non_finite:
            raise CheckFailed(f"layer {self.layer_index} produced non-finite attention weights",
                              fix=f"check the weights with 'attnviz inspect {option('scan')}'")
        first_view: dict[int, MapView] = {}
        for view in self.views:
            first_view.setdefault(view.sentence, view)
        means = [replace(first_view[b], head=None, values=total / np.float32(heads))
                 for b, (total, heads) in sorted(self._mean.items())]
        stats = [s for head in sorted(self._sums)
                 for s in finish_stats(self._sums[head], self.layer_index, first_head=head)]
        rows = torch.stack([self._rows[h] for h in sorted(self._rows)]) if self._rows else None
        return StreamedMaps(self.views + means, stats,
                            self.query_row if rows is not None else None, rows)
