"""Batched attention on sentences: one standalone layer, or the bundled attention-only model.

Results hold per-head maps (B, H, L, S) with padding still in place; `Batch.lengths` says which
rows and columns are real. Renderers slice; they never recompute.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnviz.compute.forward_pass import kernel, layer_stream, streaming
from attnviz.compute.forward_pass.forward import (
    LayerWeights,
    build_torch_mha,
    load_weights,
    per_head_forward,
    reshaped_forward,
    torch_mha_expressible,
)
from attnviz.compute.forward_pass.inputs import Batch, input_vectors, padding_mask
from attnviz.compute.forward_pass.results import SDPA_TOLERANCE, AttentionRun, standalone_layer
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckFailed, option
from attnviz.load.store import TensorStore


def layer_attention(layer: AttentionLayer, weights: LayerWeights,
                    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pad: torch.Tensor,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(output, per-head weights, method) for inputs = (query inputs x (B, L, E), key inputs,
    value inputs)."""
    x, key, value = inputs
    L = x.shape[1]
    mask = kernel.causal_mask(L, device=x.device) if causal else None
    with torch.no_grad():
        if torch_mha_expressible(layer):
            mha = build_torch_mha(layer, weights)
            # An explicit mask, never is_causal: the fast path ignores is_causal.
            out, attn = mha(x, key, value, key_padding_mask=pad, attn_mask=mask,
                            need_weights=True, average_attn_weights=False)
            return out, attn, "torch.nn.MultiheadAttention (need_weights=True)"
        parts = per_head_forward(layer, weights, x, key, value, pad, mask)
        sdpa_out, _ = reshaped_forward(layer, weights, x, key, value, pad, mask)
    scale = max(1.0, sdpa_out.abs().max().item())
    diff = (parts.out - sdpa_out).abs().max().item()
    if diff > SDPA_TOLERANCE * scale:
        raise CheckFailed(f"the per-head computation differs from "
                          f"F.scaled_dot_product_attention by {diff:.2e}", fix="report this")
    return parts.out, parts.attn, ("explicit per head (output checked against "
                                   f"F.scaled_dot_product_attention: max |Δ| {diff:.1e})")


def run_layer(layer: AttentionLayer, weights_store: TensorStore, batch: Batch,
              run: layer_stream.LayerRun, inputs_store: TensorStore | None = None,
              sink: layer_stream.RowSink | None = None) -> AttentionRun:
    """One standalone layer on a padded batch. With run.allow_stream, inputs stream in blocks of
    query rows as the memory plan decides (`attnviz.core.memory.layer_plan`: maps beyond the
    memory budget, or larger than a display and not kept: `run.keep` holds them whole whenever
    they fit), keeping the (sentence, query) row of every head for --query and handing every
    full row to `sink`, which --export writes as it comes. inputs_store: the checkpoint whose
    embeddings make the inputs, if any (attnviz.compute.forward_pass.inputs)."""
    device, causal = run.device, run.causal
    x, described = input_vectors(batch, layer.embed_dim, inputs_store, run.positions)
    # Self-attention over the same sentence; kdim/vdim ≠ E layers get vectors of their width.
    key = x if layer.kdim == layer.embed_dim else input_vectors(batch, layer.kdim, None,
                                                                run.positions)[0]
    value = x if layer.vdim == layer.embed_dim else input_vectors(batch, layer.vdim, None,
                                                                  run.positions)[0]
    pad = padding_mask(batch)
    notes = []
    plan = layer_stream.plan_for(layer, batch, run, one_head=sink is not None)
    if layer.positions not in ("none", "learned", "sinusoidal"):
        notes.append(f"this layer uses {layer.positions} positions inside attention; a standalone "
                     f"layer runs without them (use {option('positions')} sinusoidal to add "
                     "absolute positions to the inputs)")
    if run.allow_stream and plan.streamed:
        if sink is not None:
            sink.begin(described, x)
        streamed = replace(layer_stream.stream_layer(layer, weights_store, batch, (x, key), run,
                                                     sink),
                           key_inputs=None if key is x else key,
                           value_inputs=None if value is x else value)
        group = "one head" if plan.heads == 1 else f"{plan.heads} heads"
        notes.append(f"long input: maps computed {group} and sentence at a time, in blocks of "
                     "query rows, and kept only at display size "
                     f"(≤ {streaming.DISPLAY_CELLS} per side); {option('export')} "
                     + ("wrote every full map block by block" if sink is not None else
                        "writes the full maps block by block"))
        return AttentionRun(batch, (streamed,), weights_store.source, described, str(device),
                            causal, weights_store, tuple(notes))
    if sink is not None:
        raise ValueError("a row sink needs a streamed run")
    weights = load_weights(layer, weights_store, device=str(device))
    _, attn, method = layer_attention(layer, weights, (x.to(device), key.to(device),
                                                       value.to(device)), pad.to(device), causal)
    result = replace(standalone_layer(0, layer, attn.float().cpu(), x, method, causal),
                     key_inputs=None if key is x else key,
                     value_inputs=None if value is x else value)
    return AttentionRun(batch, (result,), weights_store.source, described, str(device), causal,
                        weights_store, tuple(notes))


def check_finite_maps(run: AttentionRun) -> None:
    """NaN/Inf in the maps (from NaN weights or overflow) are reported, never drawn."""
    for captured in run.layers:
        if captured.weights is None:
            continue  # streamed maps were checked head by head as they were computed
        rows, columns = captured.rows_of(run.batch), captured.columns_of(run.batch)
        for b, (row_tokens, column_tokens) in enumerate(zip(rows, columns, strict=True)):
            n, m = len(row_tokens), len(column_tokens)
            maps = captured.weights[b, :, :n, :m]
            # Softmax weights lie in [0, 1], so a row sum cannot overflow: it is finite exactly
            # when the row is (one pass of additions instead of isfinite on every entry); only
            # a map that fails is counted entry by entry, for the message.
            if bool(torch.isfinite(maps.sum(-1)).all()):
                continue
            bad = int((~torch.isfinite(maps)).sum())
            if bad:
                raise CheckFailed(f"layer {captured.index} produced {bad} non-finite attention "
                                  f"weights for sentence {b + 1}",
                                  fix=f"check the weights with 'attnviz inspect {option('scan')}'")
