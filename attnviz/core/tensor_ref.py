"""Where a weight lives in a checkpoint and how to read it out: `TensorRef`, the one decoder of
stored tensors (transposed, flattened, rows taken) for torch tensors and numpy arrays alike."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, TypeVar

RowRanges = tuple[tuple[int, int], ...]


ArrayT = TypeVar("ArrayT", bound=Any)  # a torch tensor or a numpy array


@dataclass(frozen=True)
class TensorRef:
    """Where one canonical weight or bias lives in a checkpoint, and how to read it out."""

    key: str  # tensor name in the checkpoint
    stored_shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "F32", "BF16", ...
    transposed: bool = False  # stored (in, out), like GPT-2's Conv1D
    row_ranges: RowRanges | None = None  # rows of the canonical tensor taken, in order; None = all
    flatten: bool = False  # e.g. nn.MHA's bias_k, stored (1, 1, E)

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        """Shape of the whole stored tensor in (out, in) orientation, before row selection."""
        if self.flatten:
            return (math.prod(self.stored_shape),)
        if self.transposed:
            return tuple(reversed(self.stored_shape))
        return self.stored_shape

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the tensor this reference denotes, in (out, in) orientation."""
        canon = self.canonical_shape
        if self.row_ranges is None:
            return canon
        return (sum(stop - start for start, stop in self.row_ranges), *canon[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        """Human-readable origin, e.g. `in_proj_weight[0:64]` or `c_attn.weight.T[0:768]`."""
        text = self.key + (".T" if self.transposed else "")
        if self.row_ranges is not None:
            parts = [f"{start}:{stop}" for start, stop in self.row_ranges]
            shown = ",".join(parts[:3]) + (",…" if len(parts) > 3 else "")
            text += f"[{shown}]"
        return text

    def oriented(self, stored: ArrayT) -> ArrayT:
        """The stored array in (out, in) orientation, before row selection: flattened or
        transposed as this reference says. The one decoder for torch tensors and numpy arrays
        (memory maps) alike: both have `reshape` and `.T`, and neither copies here."""
        if self.flatten:
            return stored.reshape(-1)
        return stored.T if self.transposed else stored

    def row_blocks(self, oriented: ArrayT) -> list[ArrayT]:
        """The row blocks of an `oriented` array this reference takes, in order."""
        if self.row_ranges is None:
            return [oriented]
        return [oriented[start:stop] for start, stop in self.row_ranges]

    def take(self, ranges: RowRanges) -> TensorRef:
        """A reference to rows `ranges` (relative to this reference's rows) of the same tensor."""
        base = self.row_ranges if self.row_ranges is not None else ((0, self.canonical_shape[0]),)
        return replace(self, row_ranges=_compose_ranges(base, ranges))


def _compose_ranges(base: RowRanges, ranges: RowRanges) -> RowRanges:
    """Map row ranges given relative to the concatenation of `base` back to absolute rows.

    Each range finds its first base block by bisection over the blocks' offsets and visits only
    the blocks it overlaps: taking one head's rows out of H per-head blocks costs O(log H), not
    O(H) (so all H heads cost O(H log H), not O(H²))."""
    offsets = list(itertools.accumulate((b_stop - b_start for b_start, b_stop in base),
                                        initial=0))
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        i = max(0, bisect.bisect_right(offsets, start) - 1)
        while i < len(base) and offsets[i] < stop:
            b_start = base[i][0]
            lo, hi = max(start, offsets[i]), min(stop, offsets[i + 1])
            if lo < hi:
                out.append((b_start + lo - offsets[i], b_start + hi - offsets[i]))
            i += 1
    return merge_ranges(tuple(out))


def merge_ranges(ranges: RowRanges) -> RowRanges:
    """Join adjacent ranges: ((0, 4), (4, 8)) -> ((0, 8),)."""
    merged: list[tuple[int, int]] = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)
