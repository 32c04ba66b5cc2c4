"""`attnviz heatmap`: choose the weights, build the batch, run attention, export.

Sources: the bundled attention-only model (default), one layer of a checkpoint (`--weights`), or a
randomly initialized nn.MultiheadAttention (`--random`)."""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnviz.compute.inputs import POSITION_SCHEMES, Batch
from attnviz.errors import UsageError
from attnviz.recognize.base import HeadHints
from attnviz.sources.layers import RandomSpec


@dataclass(frozen=True)
class HeatmapRequest:
    batch: Batch
    weights: Path | None = None
    layer: str | None = None
    random: RandomSpec | None = None
    hints: HeadHints = HeadHints()
    causal: bool = False
    positions: str = "none"
    device: str = "auto"
    keep_full_maps: bool = False  # --export needs every head's full map
    query_row: tuple[int, int] | None = None  # (sentence, token) of --query: kept when streaming
    max_panels: int | None = None  # the figure's panel limit, when a figure is asked for
    panels_per_map: int | None = None  # heads shown per layer and sentence (1 for --head)


def check_panels(request: HeatmapRequest, layers: int, heads: int) -> None:
    """Refuse a figure of more panels than --max-panels before any work is done."""
    if request.max_panels is None:
        return
    panels = len(request.batch.tokens) * layers * (request.panels_per_map or heads)
    if panels > request.max_panels:
        raise UsageError(f"the figure would have {panels} panels, more than --max-panels "
                         f"{request.max_panels}", "raise --max-panels, or pick --layer/--head")


def run(request: HeatmapRequest) -> Any:
    """The AttentionRun for a request (all checks before any tensor is allocated)."""
    from attnviz.compute.attention import resolve_device, run_layer
    from attnviz.core.selection import parse_layers
    from attnviz.load.checkpoint import open_checkpoint
    from attnviz.recognize import find_layers, select_layer
    from attnviz.sources import bundled as tinymodel
    from attnviz.sources import layers as sources

    if request.positions not in POSITION_SCHEMES:
        raise UsageError(f"unknown --positions {request.positions!r}",
                         f"use {' or '.join(POSITION_SCHEMES)}", "--positions")
    device = resolve_device(request.device)
    if request.random is not None:
        layer, store = sources.random_mha(request.random)
        check_panels(request, 1, layer.num_heads or 0)
        return run_layer(layer, None, request.batch, request.causal, request.positions, device,
                         store, not request.keep_full_maps, request.query_row)
    store = tinymodel.open_bundled() if request.weights is None else \
        open_checkpoint(request.weights)
    if tinymodel.is_tiny_model(store):
        if request.positions != "none":
            raise UsageError("the bundled model has its own learned positions",
                             "drop --positions", "--positions")
        layers = tinymodel.tiny_layers(store)  # checked against the metadata's counts
        chosen = parse_layers(request.layer, len(layers))
        check_panels(request, len(layers) if chosen is None else len(chosen),
                     max(layer.num_heads or 0 for layer in layers))
        return tinymodel.run_tiny(store, request.batch, chosen, device)
    inventory = find_layers(store, request.hints)
    layer = select_layer(inventory, request.layer, store.source)
    if not layer.heads_known:
        raise UsageError(f"the number of heads of layer {layer.name!r} is unknown",
                         "pass --num-heads (and --num-kv-heads for grouped-query layers)",
                         "--num-heads")
    check_panels(request, 1, layer.num_heads or 0)
    return run_layer(layer, store, request.batch, request.causal or layer.causal,
                     request.positions, device, store, not request.keep_full_maps,
                     request.query_row)


def export(run: Any, path: Path) -> None:
    """attn.{layer} (B, H, L, S), inputs.{layer} (B, L, E), mask (B, L), metadata tokens."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from attnviz.app.outputs import atomic_output, check_free_space
    from attnviz.compute.inputs import padding_mask

    tensors = {"mask": (~padding_mask(run.batch)).to(torch.int64).contiguous()}
    for captured in run.layers:
        tensors[f"attn.{captured.index}"] = captured.weights.float().contiguous()
        tensors[f"inputs.{captured.index}"] = captured.inputs.float().contiguous()
    metadata = {"tokens": json.dumps(run.batch.tokens), "source": run.source,
                "inputs": run.inputs_described, "causal": str(run.causal).lower()}
    check_free_space(path, sum(t.numel() * t.element_size() for t in tensors.values()))
    with atomic_output(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError:  # the writer's own I/O error (a full disk, a size limit)
            raise OSError(errno.EIO, "the safetensors writer failed (a full disk or a file "
                          "size limit?)") from None


def run_json(run: Any, head_stats: list[Any], breakdown: Any) -> dict[str, Any]:
    from dataclasses import asdict

    doc: dict[str, Any] = {
        "source": run.source,
        "device": run.device,
        "causal": run.causal,
        "inputs": run.inputs_described,
        "sentences": run.batch.sentences,
        "tokens": run.batch.tokens,
        "layers": [{"index": c.index, "name": c.layer.name, "num_heads": c.layer.num_heads,
                    "method": c.method} for c in run.layers],
        "head_stats": [s.to_json() for s in head_stats],
    }
    if breakdown is not None:
        doc["query"] = asdict(breakdown)
    return doc


def run_model(spec: str, sentences: list[str], layer: str | None, device: str, dtype: str,
              device_map: str | None, max_tokens: int, one_per_layer: bool,
              max_panels: int | None, keep_full_maps: bool = False,
              query: tuple[int, str] | None = None) -> Any:
    """A Hugging Face model's own attention on the sentences (the `attnviz[hf]` extra); long
    inputs stream unless keep_full_maps (--export); query = (sentence, --query) keeps that row."""
    from attnviz.core.selection import parse_layers
    from attnviz.sources import hf

    loaded = hf.load_model(spec, device, dtype, device_map)
    chosen = parse_layers(layer, len(loaded.layers))
    count = len(loaded.layers) if chosen is None else len(chosen)
    heads = max(layer.num_heads or 0 for layer in loaded.layers)
    check_panels(HeatmapRequest(Batch(sentences, [[""]] * len(sentences)),
                                max_panels=max_panels, panels_per_map=1 if one_per_layer
                                else None), count, heads)
    return hf.run_model(loaded, sentences, chosen, max_tokens, not keep_full_maps, query)
