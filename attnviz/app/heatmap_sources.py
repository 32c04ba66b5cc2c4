"""Where a heatmap's attention comes from: the bundled model (default), one layer of a checkpoint
(`--weights`), a randomly initialized nn.MultiheadAttention (`--random`), or a Hugging Face
model (`--model`); each run checked (panels, positions, memory budget) before any tensor is
allocated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.app.export import StreamedExport, run_model_exporting
from attnviz.app.standalone import head_hint_warnings, renumber, synthetic_note
from attnviz.compute.inputs import POSITION_SCHEMES, Batch, TokenLimit
from attnviz.errors import UsageError
from attnviz.recognize.base import HeadHints
from attnviz.sources.layers import RandomSpec

if TYPE_CHECKING:
    import torch

    from attnviz.compute.results import AttentionRun
    from attnviz.core.layer import AttentionLayer
    from attnviz.load.store import TensorStore


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
    keep_full_maps: bool = False  # --export of short inputs: every head's full map in memory
    maps_read: bool = False  # --weighting norm reads every full map: whole whenever they fit
    export_path: Path | None = None  # --export: long inputs are written block by block into it
    memory_budget: int | None = None  # bytes for attention maps (None: the default budget)
    query_row: tuple[int, int] | None = None  # (sentence, token) of --query: kept when streaming
    max_panels: int | None = None  # the figure's panel limit, when a figure is asked for
    panels_per_map: int | None = None  # heads shown per layer and sentence (1 for --head)


MEMORY_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
                "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}
MIN_MEMORY_BUDGET = 2**20


def parse_memory_budget(text: str | None) -> int | None:
    """--memory-budget: '512MB', '2GB', '1.5G', '300000000' (K/M/G are powers of 1024)."""
    if text is None:
        return None
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in MEMORY_UNITS:
        raise UsageError(f"cannot read the memory budget {text!r}",
                         fix="write a size such as 512MB or 2GB", option="memory_budget")
    budget = int(float(match.group(1)) * MEMORY_UNITS[unit])
    if budget < MIN_MEMORY_BUDGET:
        raise UsageError(f"a memory budget of {budget} bytes is too small to hold a block of "
                         "attention rows", fix="give at least 1MB", option="memory_budget")
    available = available_memory()
    if available is not None and budget > available:
        raise UsageError(f"a memory budget of {budget / 2**30:.1f} GB is more than the "
                         f"{available / 2**30:.1f} GB this machine has available",
                         fix=f"give at most {available // 2**20}MB", option="memory_budget")
    return budget


def available_memory() -> int | None:
    """Bytes the process can still allocate: the system's available memory (MemAvailable), or
    less under an address-space limit; None where neither can be read."""
    import os
    import resource

    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        found.append(soft)
    return min(found) if found else None


def check_panels(request: HeatmapRequest, layers: int, heads: int) -> None:
    """Refuse a figure of more panels than --max-panels before any work is done."""
    if request.max_panels is None:
        return
    panels = len(request.batch.tokens) * layers * (request.panels_per_map or heads)
    if panels > request.max_panels:
        raise UsageError(f"the figure would have {panels} panels, more than ‹max_panels› "
                         f"{request.max_panels}", fix="raise ‹max_panels›, or pick ‹layer›/‹head›")


def open_store(weights: Path | None) -> TensorStore:
    """The checkpoint of --weights, or the bundled model: headers only, no tensor read."""
    from attnviz.load.checkpoint import open_checkpoint
    from attnviz.sources import bundled

    return bundled.open_bundled() if weights is None else open_checkpoint(weights)


def source_limit(store: TensorStore, weights: Path | None) -> TokenLimit | None:
    """The bound the source itself sets on a sentence's tokens (an attnviz-tiny model's learned
    positions), checked beside --max-tokens before any work; None when it sets none."""
    from attnviz.sources import bundled

    if not bundled.is_tiny_model(store):
        return None
    return bundled.token_limit(store, "the bundled model" if weights is None else "the model")


def run(request: HeatmapRequest, warn: Callable[[str], None] | None = None,
        store: TensorStore | None = None) -> AttentionRun:
    """The AttentionRun for a request (all checks before any tensor is allocated); `warn`
    hears what the caller should know but that does not stop the run; `store`, when the
    caller opened it already (`open_store`), is the source's checkpoint."""
    from attnviz.compute.device import resolve_device
    from attnviz.core.selection import parse_layers
    from attnviz.recognize import find_layers, select_layer
    from attnviz.sources.bundled import is_tiny_model, run_tiny, tiny_layers
    from attnviz.sources.layers import random_mha

    if request.positions not in POSITION_SCHEMES:
        raise UsageError(f"unknown ‹positions› {request.positions!r}",
                         fix=f"use {' or '.join(POSITION_SCHEMES)}", option="positions")
    device = resolve_device(request.device)
    if request.random is not None:
        layer, store = random_mha(request.random)
        check_panels(request, 1, layer.num_heads or 0)
        return _run_standalone(request, layer, None, store, request.causal, device)
    store = open_store(request.weights) if store is None else store
    if is_tiny_model(store):
        if request.positions != "none":
            raise UsageError("the bundled model has its own learned positions",
                             fix="drop ‹positions›", option="positions")
        layers = tiny_layers(store)  # checked against the metadata's counts
        chosen = parse_layers(request.layer, len(layers))
        check_panels(request, len(layers) if chosen is None else len(chosen),
                     max(layer.num_heads or 0 for layer in layers))
        return run_tiny(store, request.batch, chosen, device)
    inventory = find_layers(store, request.hints)
    layer = select_layer(inventory, request.layer, store.source)
    if not layer.heads_known:
        raise UsageError(f"the number of heads of layer {layer.name!r} is unknown",
                         fix="pass ‹num_heads› (and ‹num_kv_heads› for grouped-query layers)",
                         option="num_heads")
    check_panels(request, 1, layer.num_heads or 0)
    if warn is not None and request.hints.num_heads is not None:
        for line in head_hint_warnings(store, request.hints, request.layer, layer):
            warn(line)
    index = inventory.layers.index(layer)
    attention_run = _run_standalone(request, layer, store, store,
                                    request.causal or layer.causal, device, index)
    renumber(attention_run, index)
    attention_run.notes.insert(0, synthetic_note(store, request.weights, index))
    return attention_run


def _run_standalone(request: HeatmapRequest, layer: AttentionLayer,
                    inputs_store: TensorStore | None, store: TensorStore, causal: bool,
                    device: torch.device, index: int = 0) -> AttentionRun:
    """run_layer, with --export of long inputs written block by block as the maps stream (the
    file is complete, and moved into place, only when the run succeeds)."""
    from attnviz.app.outputs import atomic_output
    from attnviz.compute import streaming
    from attnviz.compute.attention import run_layer

    extra = 1 if layer.bias_k is not None else 0
    full = request.keep_full_maps or request.export_path is not None
    if request.export_path is None or not streaming.streams(
            request.batch, layer.num_heads or 0, extra, request.memory_budget):
        return run_layer(layer, inputs_store, request.batch, causal, request.positions, device,
                         store, not full, request.query_row, request.memory_budget,
                         keep=request.maps_read)
    with atomic_output(request.export_path) as tmp, open(tmp, "wb") as file:
        sink = StreamedExport(file, request.batch, layer.num_heads or 0, extra, store.source,
                              causal, index)
        result = run_layer(layer, inputs_store, request.batch, causal, request.positions,
                           device, store, True, request.query_row, request.memory_budget, sink)
        sink.close()
    result.exported = request.export_path
    return result


def run_model(spec: str, sentences: list[str], layer: str | None, device: str, dtype: str,
              device_map: str | None, max_tokens: int, one_per_layer: bool,
              max_panels: int | None, keep_full_maps: bool = False,
              query: tuple[int, str] | None = None, targets: list[str] | None = None,
              export_path: Path | None = None, memory_budget: int | None = None,
              values: bool = False, after: Callable[..., None] | None = None
              ) -> AttentionRun:
    """A Hugging Face model's own attention on the sentences (the `attnviz[hf]` extra); long
    inputs stream unless keep_full_maps (--export: a long input's maps are then written to
    export_path block by block); query = (sentence, --query) keeps that row; targets run an
    encoder-decoder model's decoder too; values keeps each shown layer's value states
    (--weighting norm); after(loaded, plan, run), when given, runs on the finished run (the
    --ablate scorecard)."""
    from attnviz.sources import hf

    def check_shown(layers: int, heads: int) -> None:
        check_panels(HeatmapRequest(Batch(sentences, [[""]] * len(sentences)),
                                    max_panels=max_panels, panels_per_map=1 if one_per_layer
                                    else None), layers, heads)

    # every limit checked before the weights load: the inputs' lengths, and the panels as far
    # as config.json counts the layers (after the probe, by the model's own count)
    loaded, encoded = hf.load_checked(spec, sentences, targets=targets, max_tokens=max_tokens,
                                      device=device, dtype=dtype, device_map=device_map,
                                      layer=layer, check_shown=check_shown)
    plan = hf.plan_run(loaded, sentences, layer, targets, max_tokens,
                       need_layers=max_panels is not None or values or after is not None,
                       query=query is not None,
                       encoded=encoded, memory_budget=memory_budget)
    if plan.shown is not None:  # numbered by a probe: the figure's size is known before the run
        check_shown(len(plan.shown), max(shown.num_heads or 0 for shown in plan.shown))
    if export_path is not None and not values:
        exported = run_model_exporting(loaded, plan, query, export_path, memory_budget)
        if exported is not None:
            return exported
    attention_run = hf.run_model(loaded, plan, not keep_full_maps, query,
                                 memory_budget=memory_budget, values=values)
    if after is not None:
        after(loaded, plan, attention_run)
    return attention_run
