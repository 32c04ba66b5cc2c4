"""Display-ready attention maps: real tokens only, selected heads, downsampled to fit.

Downsampling keeps the meaning of a row: key blocks are summed (the attention mass a query gives
to that span of keys) and query blocks averaged, so every displayed row still sums to 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.attention import AttentionRun
from attnviz.errors import UsageError


@dataclass(frozen=True)
class MapView:
    sentence: int
    layer: int
    head: int | None  # None for the average over heads
    values: Any  # (rows, cols) numpy float32, rows = queries, cols = keys
    row_labels: list[str]
    col_labels: list[str]
    downsampled: bool

    @property
    def title(self) -> str:
        head = "mean of heads" if self.head is None else f"head {self.head}"
        return f"L{self.layer} · {head}"


def parse_layers(spec: str | None, available: int) -> list[int] | None:
    """--layer for a model: None (all), "all", "N", "-1" or "A:B" (B exclusive)."""
    if spec is None or spec == "all":
        return None
    try:
        if ":" in spec:
            start_text, stop_text = spec.split(":", 1)
            start = int(start_text) if start_text else 0
            stop = int(stop_text) if stop_text else available
            chosen = list(range(available))[start:stop]
        else:
            index = int(spec)
            if not -available <= index < available:
                raise IndexError
            chosen = [index % available]
    except (ValueError, IndexError):
        raise UsageError(f"--layer {spec!r} is not a layer of this model",
                         f"use all, 0..{available - 1}, -1 or A:B", "--layer") from None
    if not chosen:
        raise UsageError(f"--layer {spec!r} selects no layer", f"the model has {available}",
                         "--layer")
    return chosen


def check_head(head: int | None, num_heads: int) -> None:
    if head is not None and not 0 <= head < num_heads:
        raise UsageError(f"head {head} is out of range", f"choose 0..{num_heads - 1}", "--head")


def select_maps(run: AttentionRun, head: int | None, average: bool) -> list[MapView]:
    """One view per (sentence, layer, head) in that order; padding cut away."""
    views = []
    for b, tokens in enumerate(run.batch.tokens):
        n = len(tokens)
        for captured in run.layers:
            maps = captured.weights[b, :, :n, :]  # (H, n, S)
            extra = maps.shape[-1] - run.batch.max_len  # bias_k columns sit after the padding
            keys = list(range(n)) + list(range(run.batch.max_len, maps.shape[-1]))
            maps = maps[:, :, keys]
            col_labels = tokens + ["<bias_k>"] * extra
            if average:
                chosen = [(None, maps.mean(0))]
            elif head is not None:
                chosen = [(head, maps[head])]
            else:
                chosen = list(enumerate(maps))
            views += [MapView(b, captured.index, h, m.numpy(), list(tokens), col_labels, False)
                      for h, m in chosen]
    return views


def downsample(view: MapView, max_rows: int, max_cols: int) -> MapView:
    rows, cols = view.values.shape
    if rows <= max_rows and cols <= max_cols:
        return view
    values = torch.from_numpy(view.values)
    row_blocks, col_blocks = _blocks(rows, max_rows), _blocks(cols, max_cols)
    summed = torch.stack([values[:, a:b].sum(1) for a, b in col_blocks], 1)
    averaged = torch.stack([summed[a:b].mean(0) for a, b in row_blocks], 0)
    return MapView(view.sentence, view.layer, view.head, averaged.numpy(),
                   _block_labels(view.row_labels, row_blocks),
                   _block_labels(view.col_labels, col_blocks), True)


def _blocks(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(n, parts))
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


def _block_labels(labels: list[str], blocks: list[tuple[int, int]]) -> list[str]:
    return [labels[a] if b - a == 1 else f"{a}-{b - 1}" for a, b in blocks]
