"""The bundled attention-only model (family "attnviz-tiny", see sample_weights/train_induction.py),
shipped as package data: attnviz/data/induction.safetensors.

x = embed[ids] + pos_embed[0:L]; for each layer: x = x + MHA_i(LN_i(x)) with a causal mask;
its attention layers are plain nn.MultiheadAttention state dicts under `layers.{i}.self_attn.`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass.attention import layer_attention
from attnviz.compute.forward_pass.forward import load_weights
from attnviz.compute.forward_pass.inputs import Batch, TokenLimit, length_problem, padding_mask
from attnviz.compute.forward_pass.results import AttentionRun, standalone_layer
from attnviz.core.layer import AttentionLayer
from attnviz.core.request import HeadHints
from attnviz.core.words import hashed_ids
from attnviz.data import BUNDLED
from attnviz.errors import CheckpointError, UsageError, option, quoted
from attnviz.load.checkpoint import open_checkpoint
from attnviz.load.store import TensorStore
from attnviz.recognize import find_layers
from attnviz.recognize.base import metadata_int

FAMILY = "attnviz-tiny"


def is_tiny_model(store: TensorStore) -> bool:
    return store.metadata.get("attnviz_family") == FAMILY


def open_bundled() -> TensorStore:
    if not BUNDLED.is_file():
        raise CheckpointError("the bundled model attnviz/data/induction.safetensors is missing",
                              fix="reinstall attnviz, regenerate it with "
                              "'python sample_weights/train_induction.py', or pass "
                              f"{option('weights')}",
                              where=str(BUNDLED))
    return open_checkpoint(BUNDLED)


def tiny_layers(store: TensorStore) -> list[AttentionLayer]:
    """The model's attention layers, in order; the metadata's counts must be what the file
    holds (a `num_layers` of 10⁸ must not size any loop)."""
    layers = find_layers(store, HeadHints()).layers
    if not layers:
        raise CheckpointError("the model holds no attention layer", where=store.source)
    _expect(store, "num_layers", len(layers), f"{len(layers)} attention layers")
    for i, layer in enumerate(layers):
        if layer.name != f"layers.{i}.self_attn":
            raise CheckpointError(f"attention layer {i} is named {quoted(layer.name)}, not "
                                  f"'layers.{i}.self_attn'", where=store.source)
    return layers


def _expect(store: TensorStore, name: str, actual: int, holds: str) -> None:
    claimed = metadata_int(store, name)
    if claimed is not None and claimed != actual:
        raise CheckpointError(f"the metadata's {name} is {claimed}, but the file holds {holds}",
                              fix="fix the metadata, or regenerate the model", where=store.source)


def check_shapes(store: TensorStore, layers: list[AttentionLayer]) -> None:
    """Every tensor the forward reads has the width of the residual stream: the tables'
    columns, each LayerNorm's weight and bias, each layer's input and output."""
    width = store.info("embed.weight").shape[1]

    def expect(name: str, shape: tuple[int, ...]) -> None:
        if name not in store:
            raise CheckpointError(f"the model lacks {quoted(name)}", where=store.source)
        held = tuple(store.info(name).shape)
        if held != shape:
            raise CheckpointError(f"{quoted(name)} has shape {held}, expected {shape} (the "
                                  f"residual stream is {width} wide)",
                                  fix="regenerate the model", where=store.source)

    expect("pos_embed.weight", (_table_rows(store, "pos_embed.weight"), width))
    for i, layer in enumerate(layers):
        expect(f"layers.{i}.ln.weight", (width,))
        expect(f"layers.{i}.ln.bias", (width,))
        if layer.embed_dim != width or layer.o_weight.shape[0] != width:
            raise CheckpointError(f"attention layer {i} maps {layer.embed_dim} features to "
                                  f"{layer.o_weight.shape[0]}, but the residual stream is "
                                  f"{width} wide", fix="regenerate the model",
                                  where=store.source)


def _table_rows(store: TensorStore, name: str) -> int:
    if name not in store or len(store.info(name).shape) != 2:
        raise CheckpointError(f"the model lacks its 2-D {name}", where=store.source)
    return store.info(name).shape[0]


def token_limit(store: TensorStore, holder: str = "the model") -> TokenLimit:
    """The model's learned positions as a bound on sentence length, from the header alone (so
    it is checked with --max-tokens, before any tensor is read); the metadata's count must be
    the rows of its position table."""
    max_positions = metadata_int(store, "max_positions")
    if max_positions is None:
        raise CheckpointError("the model's metadata lacks max_positions", where=store.source)
    _expect(store, "max_positions", _table_rows(store, "pos_embed.weight"),
            "that many position rows")
    return TokenLimit(max_positions, holder)


def run_tiny(store: TensorStore, batch: Batch, layer_indices: list[int] | None,
             device: torch.device) -> AttentionRun:
    """The whole model on a padded batch, capturing each requested layer's input and weights."""
    vocab_size = metadata_int(store, "vocab_size")
    if vocab_size is None:
        raise CheckpointError("the model's metadata lacks vocab_size", where=store.source)
    # Word ids index the embedding and positions its position table: both must exist.
    _expect(store, "vocab_size", _table_rows(store, "embed.weight"),
            "that many embedding rows")
    limit = token_limit(store)
    for b, tokens in enumerate(batch.tokens):  # callers that skipped make_batch's check
        problem = length_problem(f"sentence {b + 1}", len(tokens), None, limit)
        if problem is not None:
            raise UsageError(problem[0], fix=problem[1])
    layers = tiny_layers(store)
    check_shapes(store, layers)
    wanted = set(range(len(layers)) if layer_indices is None else layer_indices)
    ids = torch.zeros(len(batch.tokens), batch.max_len, dtype=torch.long)
    for b, tokens in enumerate(batch.tokens):
        ids[b, : len(tokens)] = torch.tensor(hashed_ids(tokens, vocab_size))
    pad = padding_mask(batch).to(device)

    def param(name: str) -> torch.Tensor:
        return store.read(name).float().to(device)

    embed, pos = param("embed.weight"), param("pos_embed.weight")
    x = embed[ids.to(device)] + pos[: batch.max_len][None]  # (B, L, E)
    captured = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            h = F.layer_norm(x, (x.shape[-1],), param(f"layers.{i}.ln.weight"),
                             param(f"layers.{i}.ln.bias"), eps=1e-5)
            weights = load_weights(layer, store, device=str(device))
            out, attn, method = layer_attention(layer, weights, (h, h, h), pad, causal=True)
            if i in wanted:
                captured.append(standalone_layer(i, layer, attn.float().cpu(), h.float().cpu(),
                                                 method, True))
            x = x + out
    described = ("the bundled model's own embeddings of hashed word ids, plus its learned "
                 "positions; each layer's input is LayerNorm of the residual stream")
    return AttentionRun(batch, tuple(captured), store.source, described, str(device), True,
                        store)
