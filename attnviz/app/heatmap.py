"""`attnviz heatmap`: choose the weights, build the batch, run attention, export.

Sources: the bundled attention-only model (default), one layer of a checkpoint (`--weights`), or a
randomly initialized nn.MultiheadAttention (`--random`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from attnviz.compute.inputs import (
    DEFAULT_MAX_SENTENCES,
    DEFAULT_MAX_TOKENS,
    POSITION_SCHEMES,
    Batch,
)
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
                         f"{request.max_panels}", fix="raise --max-panels, or pick --layer/--head")


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
                         fix=f"use {' or '.join(POSITION_SCHEMES)}", option="--positions")
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
                             fix="drop --positions", option="--positions")
        count = int(store.metadata.get("num_layers", "0") or 0)
        chosen = parse_layers(request.layer, count)
        check_panels(request, count if chosen is None else len(chosen),
                     int(store.metadata.get("num_heads", "0") or 0))
        return tinymodel.run_tiny(store, request.batch, chosen, device)
    inventory = find_layers(store, request.hints)
    layer = select_layer(inventory, request.layer, store.source)
    if not layer.heads_known:
        raise UsageError(f"the number of heads of layer {layer.name!r} is unknown",
                         fix="pass --num-heads (and --num-kv-heads for grouped-query layers)",
                         option="--num-heads")
    check_panels(request, 1, layer.num_heads or 0)
    return run_layer(layer, store, request.batch, request.causal or layer.causal,
                     request.positions, device, store, not request.keep_full_maps,
                     request.query_row)


# --export names per kind of layer: (maps, inputs) key prefixes.
EXPORT_NAMES = {"self": ("attn", "inputs"), "decoder-self": ("decoder", "inputs.decoder"),
                "cross": ("cross", "inputs.cross")}


def export_key(captured: Any) -> tuple[str, str]:
    """(maps key, inputs key) of a layer: attn.N / inputs.N, decoder.N / inputs.decoder.N and
    cross.N / inputs.cross.N, N its number within its stack."""
    maps, inputs = EXPORT_NAMES[captured.kind]
    number = captured.display_label.split()[-1]
    return f"{maps}.{number}", f"{inputs}.{number}"


def export(run: Any, path: Path) -> None:
    """attn.{layer} (B, H, L, S), inputs.{layer} (B, L, E) where captured, mask (B, L),
    metadata tokens; with a decoder run also decoder.{layer} (B, H, T, T), cross.{layer}
    (B, H, T, S), inputs.decoder.{layer} / inputs.cross.{layer}, target_mask (B, T) and
    metadata target_tokens."""
    import torch
    from safetensors.torch import save_file

    from attnviz.app.outputs import atomic_output
    from attnviz.compute.inputs import padding_mask

    tensors = {"mask": (~padding_mask(run.batch)).to(torch.int64).contiguous()}
    metadata = {"tokens": json.dumps(run.batch.tokens), "source": run.source,
                "inputs": run.inputs_described, "causal": str(run.causal).lower()}
    if run.target is not None:
        tensors["target_mask"] = (~padding_mask(run.target)).to(torch.int64).contiguous()
        metadata["target_tokens"] = json.dumps(run.target.tokens)
    if run.path is not None:
        metadata["path"] = run.path
    for captured in run.layers:
        maps_key, inputs_key = export_key(captured)
        tensors[maps_key] = captured.weights.float().contiguous()
        if captured.inputs is not None:
            tensors[inputs_key] = captured.inputs.float().contiguous()
    with atomic_output(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def run_json(run: Any, head_stats: list[Any], breakdown: Any) -> dict[str, Any]:
    from dataclasses import asdict

    doc: dict[str, Any] = {
        "source": run.source,
        "device": run.device,
        "causal": run.causal,
        "inputs": run.inputs_described,
        "sentences": run.batch.sentences,
        "tokens": run.batch.tokens,
        "layers": [{"index": c.index, "label": c.display_label, "kind": c.kind,
                    "name": c.display_name, "num_heads": c.heads, "method": c.method}
                   for c in run.layers],
        "head_stats": [s.to_json() for s in head_stats],
    }
    if run.target is not None:
        doc["targets"] = run.target.sentences
        doc["target_tokens"] = run.target.tokens
    if run.path is not None:
        doc["path"] = run.path
    if breakdown is not None:
        doc["query"] = asdict(breakdown)
    return doc


def run_model(spec: str, sentences: list[str], layer: str | None, device: str, dtype: str,
              device_map: str | None, max_tokens: int, one_per_layer: bool,
              max_panels: int | None, keep_full_maps: bool = False,
              query: tuple[int, str] | None = None, targets: list[str] | None = None) -> Any:
    """A Hugging Face model's own attention on the sentences (the `attnviz[hf]` extra); long
    inputs stream unless keep_full_maps (--export); query = (sentence, --query) keeps that row;
    targets run an encoder-decoder model's decoder too."""
    from attnviz.sources import hf

    loaded = hf.load_model(spec, device, dtype, device_map)
    plan = hf.plan_run(loaded, sentences, layer, targets, max_tokens,
                       need_layers=max_panels is not None, query=query is not None)
    if plan.shown is not None:  # numbered by a probe: the figure's size is known before the run
        heads = max(shown.num_heads or 0 for shown in plan.shown)
        check_panels(HeatmapRequest(Batch(sentences, [[""]] * len(sentences)),
                                    max_panels=max_panels, panels_per_map=1 if one_per_layer
                                    else None), len(plan.shown), heads)
    return hf.run_model(loaded, plan, not keep_full_maps, query)


@dataclass(frozen=True)
class HeatmapJob:
    """Everything `attnviz heatmap` was asked for: the sentences, one source (the bundled model
    unless `weights`, `model` or `random` is given) and what to show."""

    sentences: list[str]
    weights: Path | None = None
    model: str | None = None
    random: RandomSpec | None = None
    layer: str | None = None
    hints: HeadHints = HeadHints()
    causal: bool = False
    positions: str = "none"
    device: str = "auto"
    dtype: str = "float32"  # --model only
    device_map: str | None = None  # --model only
    head: int | None = None
    average: bool = False
    query: str | None = None
    sentence: int = 1  # which sentence --query refers to, 1-based
    keep_full_maps: bool = False  # --export needs every head's full map
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_sentences: int = DEFAULT_MAX_SENTENCES
    max_panels: int | None = None  # the figure's panel limit, when a figure is asked for
    targets: list[str] | None = None  # --model, encoder-decoder: the decoder's text per sentence


@dataclass
class HeatmapResult:
    run: Any  # compute.results.AttentionRun
    head_stats: list[Any]  # compute.stats.HeadStats, per (layer, head)
    views: list[Any]  # compute.maps.MapView: the selected maps, per (sentence, layer, head)
    breakdown: Any = None  # compute.attention.QueryBreakdown for --query

    def to_json(self) -> dict[str, Any]:
        return run_json(self.run, self.head_stats, self.breakdown)

    def export(self, path: Path) -> None:
        export(self.run, path)


def check_applicable(job: HeatmapJob) -> None:
    """A flag that does not apply to the chosen source is a usage error, never ignored."""
    if sum((job.random is not None, job.weights is not None, job.model is not None)) > 1:
        raise UsageError("--random, --weights and --model exclude each other", fix="choose one")
    if job.model is not None:
        ignored = [flag for flag, given in (
            ("--causal", job.causal), ("--positions", job.positions != "none"),
            ("--num-heads", job.hints.num_heads is not None),
            ("--num-kv-heads", job.hints.num_kv_heads is not None),
            ("--head-dim", job.hints.head_dim is not None)) if given]
        if ignored:
            raise UsageError(f"{', '.join(ignored)} do{'es' if len(ignored) == 1 else ''} not "
                             "apply to --model: the model's own config decides",
                             fix=f"drop {', '.join(ignored)}")
    elif job.dtype != "float32" or job.device_map is not None:
        raise UsageError("--dtype and --device-map apply to --model only",
                         fix="drop them, or pass --model")
    if job.targets is not None and job.model is None:
        raise UsageError("--target applies to --model (an encoder-decoder model) only",
                         fix="drop --target, or pass --model", option="--target")


def run_heatmap(job: HeatmapJob) -> HeatmapResult:
    """The attention maps, statistics and --query breakdown a heatmap job asks for (all limits
    and flags checked before any weight is read)."""
    from attnviz.compute.inputs import find_query, make_batch

    check_applicable(job)
    if job.model is not None:  # the model's own tokenizer decides the tokens
        if not job.sentences:
            raise UsageError("no sentence given", fix="pass one or more sentences, or --file FILE")
        _check_sentence(job, len(job.sentences))
        attention_run = run_model(
            job.model, job.sentences, job.layer, job.device, job.dtype, job.device_map,
            job.max_tokens, job.head is not None or job.average, job.max_panels,
            keep_full_maps=job.keep_full_maps,
            query=None if job.query is None else (job.sentence - 1, job.query),
            targets=job.targets)
    else:
        batch = make_batch(job.sentences, job.max_tokens, job.max_sentences)
        _check_sentence(job, len(batch.tokens))
        query_row = None
        if job.query is not None:  # fail before any work
            query_row = job.sentence - 1, find_query(batch.tokens[job.sentence - 1], job.query)
        attention_run = run(HeatmapRequest(
            batch, job.weights, job.layer, job.random, job.hints, job.causal, job.positions,
            job.device, keep_full_maps=job.keep_full_maps, query_row=query_row,
            max_panels=job.max_panels,
            panels_per_map=1 if job.head is not None or job.average else None))
    return summarize(attention_run, job.head, job.average, job.query, job.sentence - 1)


def _check_sentence(job: HeatmapJob, count: int) -> None:
    if not 1 <= job.sentence <= count:
        raise UsageError(f"--sentence {job.sentence} is out of range",
                         fix=f"choose 1..{count}", option="--sentence")


def summarize(attention_run: Any, head: int | None, average: bool, query: str | None,
              sentence_index: int) -> HeatmapResult:
    """Statistics, the selected maps and the --query breakdown of a finished run."""
    from attnviz.compute import maps
    from attnviz.compute import stats as stats_mod
    from attnviz.compute.attention import check_finite_maps, query_breakdown
    from attnviz.compute.inputs import find_query

    for captured in attention_run.layers:
        maps.check_head(head, captured.heads)
    check_finite_maps(attention_run)
    head_stats: list[Any] = []
    batch = attention_run.batch
    for captured in attention_run.layers:
        if captured.weights is None:
            head_stats += captured.stats or []
            continue
        cross = captured.kind == "cross"
        found = stats_mod.head_stats(captured.weights, captured.rows_of(batch), captured.index,
                                     key_tokens=captured.columns_of(batch) if cross else None)
        if captured.label is not None:
            found = [replace(s, layer_label=captured.label) for s in found]
        head_stats += found
    selected = maps.select_maps(attention_run, head, average)
    breakdown = None
    if query is not None:
        last = attention_run.layers[-1]
        query_index = find_query(last.rows_of(batch)[sentence_index], query)
        breakdown = query_breakdown(attention_run, last.index, sentence_index, query_index)
    return HeatmapResult(attention_run, head_stats, selected, breakdown)
