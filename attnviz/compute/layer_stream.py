"""A standalone layer on long inputs: the kernel's block form (`kernel.block_softmax`) run one
head and sentence at a time, in blocks of query rows sized by the memory budget, each block
reduced at once by a `MapReducer` (and handed whole to a `RowSink` for --export).
"""

from __future__ import annotations

from typing import Protocol

import torch

from attnviz.compute import kernel
from attnviz.compute.forward import load_weights
from attnviz.compute.inputs import Batch
from attnviz.compute.results import LayerAttention
from attnviz.compute.streaming import STREAMED, MapReducer, block_rows
from attnviz.core.layer import AttentionLayer
from attnviz.load.checkpoint import TensorStore


class RowSink(Protocol):
    """Where full rows go as they are computed (the streamed --export): `begin` once with the
    layer's inputs (B, L, E) and how they were made, then every block of rows in order."""

    def begin(self, inputs_described: str, inputs: torch.Tensor) -> None: ...

    def rows(self, sentence: int, head: int, row_start: int, attn: torch.Tensor,
             keys: int) -> None: ...


def stream_layer(layer: AttentionLayer, store: TensorStore, batch: Batch, x: torch.Tensor,
                 key: torch.Tensor, causal: bool, device: torch.device,
                 query_row: tuple[int, int] | None = None, budget: int | None = None,
                 sink: RowSink | None = None) -> LayerAttention:
    """Per-head maps → display views (per sentence and head, plus their mean) and statistics,
    for query inputs x (B, L, E) and key inputs (B, S, kdim); values do not enter the maps.
    With query_row = (sentence, query), that row of every head is kept too, for --query.

    Each sentence runs alone over its real keys: that equals its rows of the padded batch,
    whose key padding mask only removes the padded keys. A sink also gets every row of the
    padded batch (padded queries included) in (sentence, head, row) order, for --export.
    """
    weights = load_weights(layer, store, device=str(device))
    extra = 1 if weights.bias_k is not None else 0
    reducer = MapReducer(0, batch.tokens, query_row, extra)
    rows = block_rows(budget, batch.max_len + extra, device)
    size = rows * (batch.max_len + extra)
    scores_buf = torch.empty(size, device=device)
    weights_buf = torch.empty(size, device=device)
    scale = layer.effective_scale
    with torch.inference_mode():
        for b, tokens in enumerate(batch.tokens):
            n = len(tokens)
            length = batch.max_len if sink is not None else n  # padded queries only for a sink
            xb, kb = x[b, :length].to(device), key[b, :n].to(device)
            cached: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
            for h in range(layer.num_heads or 0):
                # Projections per head, the scale folded into q (as kernel.scaled_scores
                # does): O(L · d) per head, never O(L · S).
                q = kernel.project(xb, weights.W_q, weights.b_q, layer.q_rows(h)).mul_(scale)
                kv = layer.kv_head_of(h)
                if cached is None or cached[0] != kv:
                    k0, k1 = layer.kv_rows(kv)
                    k_extra = None if weights.bias_k is None else weights.bias_k[None, k0:k1]
                    cached = kv, kernel.project(kb, weights.W_k, weights.b_k, (k0, k1)), k_extra
                _, k, k_extra = cached
                for start in range(0, length, rows):
                    attn, scores, keys = kernel.block_softmax(
                        q[start:start + rows], k, k_extra, start, causal, scores_buf,
                        weights_buf)
                    if sink is not None:
                        sink.rows(b, h, start, attn, keys)
                    real = min(attn.shape[0], n - start)  # padded queries are not shown
                    if real > 0:
                        reducer.add_rows(b, h, start, attn[None, :real], scores[None, :real])
    return reducer.finish(layer, x.cpu(), f"explicit per head, streamed ({STREAMED}, "
                                          f"{rows} row{'s' if rows > 1 else ''} per block)")

