"""A standalone layer on long inputs: the kernel's block form (`kernel.block_softmax`) run one
sentence at a time, in blocks of query rows of one or more heads sized by the memory plan
(`attnviz.core.memory.layer_plan`), each block reduced at once by a `MapReducer` (and handed
whole to a `RowSink` for --export).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass import kernel
from attnviz.compute.forward_pass.forward import LayerWeights, load_weights
from attnviz.compute.forward_pass.inputs import Batch
from attnviz.compute.forward_pass.results import LayerAttention, standalone_layer
from attnviz.compute.forward_pass.streaming import MapReducer
from attnviz.core import memory
from attnviz.core.layer import AttentionLayer
from attnviz.core.tensor_ref import merge_ranges
from attnviz.load.store import TensorStore


@dataclass(frozen=True)
class LayerRun:
    """How a standalone layer runs: what every step below the use case reads from the request,
    resolved (the device) and reduced to what the kernel needs."""

    device: torch.device
    causal: bool = False
    positions: str = "none"  # the inputs' position scheme (attnviz.compute.forward_pass.inputs)
    budget: int | None = None  # bytes the maps may take (None: the default budget)
    allow_stream: bool = True  # False: maps whole whatever their size (the API's choice)
    keep: bool = False  # the caller reads the full maps: hold them whole when they fit
    query_row: tuple[int, int] | None = None  # (sentence, query) whose row every head keeps
    views: bool = True  # display views kept (False: statistics alone)


def maps_shape(layer: AttentionLayer, batch: Batch) -> memory.MapsShape:
    """The size of a layer's maps on a padded batch, for the memory plan."""
    return memory.MapsShape(len(batch.tokens), batch.max_len, layer.num_heads or 0,
                            layer.extra_keys)


def plan_for(layer: AttentionLayer, batch: Batch, run: LayerRun, one_head: bool = False
             ) -> memory.MemoryPlan:
    """The memory plan of this layer on this batch, run this way."""
    return memory.layer_plan(maps_shape(layer, batch), run.budget,
                             on_cpu=run.device.type == "cpu", one_head=one_head, keep=run.keep)


class RowSink(Protocol):
    """Where full rows go as they are computed (the streamed --export): `begin` once with the
    layer's inputs (B, L, E) and how they were made, then every block of rows in order."""

    def begin(self, inputs_described: str, inputs: torch.Tensor) -> None: ...

    def rows(self, sentence: int, head: int, row_start: int, attn: torch.Tensor,
             keys: int) -> None: ...


def stream_layer(layer: AttentionLayer, store: TensorStore, batch: Batch,
                 inputs: tuple[torch.Tensor, torch.Tensor], run: LayerRun,
                 sink: RowSink | None = None) -> LayerAttention:
    """Per-head maps → display views (per sentence and head, plus their mean) and statistics,
    for inputs = (query inputs x (B, L, E), key inputs (B, S, kdim)); values do not enter the
    maps. With run.query_row = (sentence, query), that row of every head is kept too, for
    --query.

    Each sentence runs alone over its real keys: that equals its rows of the padded batch,
    whose key padding mask only removes the padded keys. Blocks hold the memory plan's rows of
    as many heads as the budget allows. A sink also gets every row of the padded batch (padded
    queries included) in (sentence, head, row) order, for --export (one head per block).
    """
    x, key = inputs
    device, causal = run.device, run.causal
    weights = load_weights(layer, store, device=str(device))
    extra = layer.extra_keys
    heads = layer.num_heads or 0
    plan = plan_for(layer, batch, replace(run, keep=False), one_head=sink is not None)
    reducer = MapReducer(0, batch.tokens, run.query_row, extra, run.views)
    size = plan.heads * plan.rows * (batch.max_len + extra)
    buffers = torch.empty(size, device=device), torch.empty(size, device=device)
    with torch.inference_mode():
        for b, tokens in enumerate(batch.tokens):
            n = len(tokens)
            length = batch.max_len if sink is not None else n  # padded queries only for a sink
            xb, kb = x[b, :length].to(device), key[b, :n].to(device)
            for h0 in range(0, heads, plan.heads):
                group = range(h0, min(heads, h0 + plan.heads))
                q, k, k_extra = _project(layer, weights, group, xb, kb)
                for start in range(0, length, plan.rows):
                    attn, scores, keys, top = kernel.block_softmax(
                        q[:, start:start + plan.rows], k, k_extra, start, causal, buffers)
                    if sink is not None:
                        sink.rows(b, h0, start, attn[0], keys)
                    real = min(attn.shape[1], n - start)  # padded queries are not shown
                    if real > 0:
                        reducer.add_rows(b, h0, start, attn[:, :real], scores[:, :real],
                                         top[:, :real])
    rows = plan.rows
    return standalone_layer(0, layer, reducer.finish(), x.cpu(),
                            f"explicit per head, streamed ({plan.describe()}, "
                            f"{rows} row{'s' if rows > 1 else ''} per block)", causal)


def _project(layer: AttentionLayer, weights: LayerWeights, heads: range, x: torch.Tensor,
             key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q (h, L, d) scaled, k (h, n, d), bias_k (h, 1, d) or None) for a group of heads: one
    projection each for q and k over the rows of those heads (and their key/value heads);
    the scale folded into q, as kernel.scaled_scores does. O(h · L · d), never O(L · S)."""
    q_rows = [layer.q_rows(h) for h in heads]
    kv_heads = [layer.kv_head_of(h) for h in heads]
    groups = sorted(set(kv_heads))
    kv_rows = [layer.kv_rows(g) for g in groups]
    q = F.linear(x, _need(_rows(weights.W_q, q_rows)), _rows(weights.b_q, q_rows))  # (L, h·d)
    k = F.linear(key, _need(_rows(weights.W_k, kv_rows)), _rows(weights.b_k, kv_rows))
    h, d = len(heads), q.shape[-1] // len(heads)
    q = q.view(x.shape[0], h, d).transpose(0, 1).mul_(layer.effective_scale)  # (h, L, d)
    k = k.view(key.shape[0], len(groups), d).transpose(0, 1)  # (g, n, d)
    which = torch.tensor([groups.index(g) for g in kv_heads], device=k.device)
    k = k.contiguous() if groups == kv_heads else k.index_select(0, which)  # (h, n, d)
    if weights.bias_k is None:
        return q.contiguous(), k, None
    extra = _need(_rows(weights.bias_k, kv_rows)).view(len(groups), 1, d)
    return q.contiguous(), k, extra.index_select(0, which)


def _need(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor


def _rows(tensor: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    """The rows of these ranges, one after another (a view when they are one range)."""
    if tensor is None:
        return None
    parts = [tensor[start:stop] for start, stop in merge_ranges(tuple(ranges))]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
