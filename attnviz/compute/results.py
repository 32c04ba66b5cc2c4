"""What a run produces: per-layer captured attention and the run around it.

Results hold per-head maps (B, H, L, S) with padding still in place; `Batch.lengths` says which
rows and columns are real. Renderers slice; they never recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attnviz.compute.inputs import Batch
from attnviz.core.layer import AttentionLayer
from attnviz.load.checkpoint import TensorStore

SDPA_TOLERANCE = 1e-4  # explicit per-head output vs F.scaled_dot_product_attention, relative


@dataclass
class LayerAttention:
    index: int  # position of the layer in the model (0 for a standalone layer)
    layer: AttentionLayer
    weights: torch.Tensor | None  # (B, H, L, S) float32 on the CPU; None when streamed
    # (B, L, E) the vectors entering the layer; None for a streamed model layer before the last
    inputs: torch.Tensor | None
    method: str  # which computation produced the weights
    key_inputs: torch.Tensor | None = None  # (B, S, kdim) when kdim ≠ E, else None (= inputs)
    value_inputs: torch.Tensor | None = None
    # Streamed long inputs keep only display-sized maps and statistics (see
    # attnviz.compute.streaming), and for --query that query's row of every head: (H, S) for
    # (sentence, query) = query_row.
    views: list[Any] | None = None
    stats: list[Any] | None = None
    query_row: tuple[int, int] | None = None
    query_weights: torch.Tensor | None = None


@dataclass
class AttentionRun:
    batch: Batch
    layers: list[LayerAttention]
    source: str
    inputs_described: str
    device: str
    causal: bool
    store: TensorStore  # where the layers' weights are read from
    notes: list[str] = field(default_factory=list)
    # how closely a float32 recomputation from the slices must match these maps (looser for a
    # model run in half precision)
    tolerance: float = SDPA_TOLERANCE
    exported: Any = None  # the --export path a streamed run already wrote, block by block

    def layer(self, index: int) -> LayerAttention:
        return next(layer for layer in self.layers if layer.index == index)
