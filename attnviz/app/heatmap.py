"""`attnviz heatmap`: choose the weights, build the batch, run attention, export.

Sources: the bundled attention-only model (default), one layer of a checkpoint (`--weights`), or a
randomly initialized nn.MultiheadAttention (`--random`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attnviz.app.export import StreamedExport, export, run_model_exporting
from attnviz.app.naming import run_title
from attnviz.app.standalone import head_hint_warnings, renumber, synthetic_note
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
    keep_full_maps: bool = False  # --export of short inputs: every head's full map in memory
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
                         fix="write a size such as 512MB or 2GB", option="--memory-budget")
    budget = int(float(match.group(1)) * MEMORY_UNITS[unit])
    if budget < MIN_MEMORY_BUDGET:
        raise UsageError(f"a memory budget of {budget} bytes is too small to hold a block of "
                         "attention rows", fix="give at least 1MB", option="--memory-budget")
    return budget


def check_panels(request: HeatmapRequest, layers: int, heads: int) -> None:
    """Refuse a figure of more panels than --max-panels before any work is done."""
    if request.max_panels is None:
        return
    panels = len(request.batch.tokens) * layers * (request.panels_per_map or heads)
    if panels > request.max_panels:
        raise UsageError(f"the figure would have {panels} panels, more than --max-panels "
                         f"{request.max_panels}", fix="raise --max-panels, or pick --layer/--head")


def run(request: HeatmapRequest, warn: Callable[[str], None] | None = None) -> Any:
    """The AttentionRun for a request (all checks before any tensor is allocated); `warn`
    hears what the caller should know but that does not stop the run."""
    from attnviz.compute.attention import resolve_device
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
        return _run_standalone(request, layer, None, store, request.causal, device)
    store = tinymodel.open_bundled() if request.weights is None else \
        open_checkpoint(request.weights)
    if tinymodel.is_tiny_model(store):
        if request.positions != "none":
            raise UsageError("the bundled model has its own learned positions",
                             fix="drop --positions", option="--positions")
        layers = tinymodel.tiny_layers(store)  # checked against the metadata's counts
        chosen = parse_layers(request.layer, len(layers))
        check_panels(request, len(layers) if chosen is None else len(chosen),
                     max(layer.num_heads or 0 for layer in layers))
        return tinymodel.run_tiny(store, request.batch, chosen, device)
    inventory = find_layers(store, request.hints)
    layer = select_layer(inventory, request.layer, store.source)
    if not layer.heads_known:
        raise UsageError(f"the number of heads of layer {layer.name!r} is unknown",
                         fix="pass --num-heads (and --num-kv-heads for grouped-query layers)",
                         option="--num-heads")
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


def _run_standalone(request: HeatmapRequest, layer: Any, inputs_store: Any, store: Any,
                    causal: bool, device: Any, index: int = 0) -> Any:
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
                         store, not full, request.query_row, request.memory_budget)
    with atomic_output(request.export_path) as tmp, open(tmp, "wb") as file:
        sink = StreamedExport(file, request.batch, layer.num_heads or 0, extra, store.source,
                              causal, index)
        result = run_layer(layer, inputs_store, request.batch, causal, request.positions,
                           device, store, True, request.query_row, request.memory_budget, sink)
        sink.close()
    result.exported = request.export_path
    return result


# --export names per kind of layer: (maps, inputs) key prefixes.
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
              query: tuple[int, str] | None = None, targets: list[str] | None = None,
              export_path: Path | None = None, memory_budget: int | None = None) -> Any:
    """A Hugging Face model's own attention on the sentences (the `attnviz[hf]` extra); long
    inputs stream unless keep_full_maps (--export: a long input's maps are then written to
    export_path block by block); query = (sentence, --query) keeps that row; targets run an
    encoder-decoder model's decoder too."""
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
                       need_layers=max_panels is not None, query=query is not None,
                       encoded=encoded, memory_budget=memory_budget)
    if plan.shown is not None:  # numbered by a probe: the figure's size is known before the run
        check_shown(len(plan.shown), max(shown.num_heads or 0 for shown in plan.shown))
    if export_path is not None:
        exported = run_model_exporting(loaded, plan, query, export_path, memory_budget)
        if exported is not None:
            return exported
    return hf.run_model(loaded, plan, not keep_full_maps, query, memory_budget=memory_budget)


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
    export_path: Path | None = None  # --export: long inputs are written block by block into it
    memory_budget: int | None = None  # bytes for attention maps (None: the default budget)
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
    warnings: list[str] = field(default_factory=list)  # for stderr: the run went on

    def to_json(self, ranked: bool = False) -> dict[str, Any]:
        doc = run_json(self.run, self.head_stats, self.breakdown)
        if ranked:
            doc["ranking"] = [r.to_json() for r in self.ranking()]
        return doc

    def ranking(self, top: int = 3) -> list[Any]:
        """compute.ranking.HeadRanking per head type: the `top` heads of each."""
        from attnviz.compute.ranking import rank_heads

        return rank_heads(self.head_stats, top)

    def export(self, path: Path) -> None:
        export(self.run, path)

    def title(self) -> str:
        """A figure's title: the model (not a raw path) and the layers shown."""
        return run_title(self.run)


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


def run_heatmap(job: HeatmapJob, progress: Callable[[str], None] | None = None
                ) -> HeatmapResult:
    """The attention maps, statistics and --query breakdown a heatmap job asks for (all limits
    and flags checked before any weight is read). `progress` hears, in words, each step as it
    starts (the CLI shows them beside a spinner)."""
    from attnviz.compute.inputs import find_query, make_batch

    check_applicable(job)
    report = progress or (lambda message: None)
    warnings: list[str] = []
    if job.model is not None:  # the model's own tokenizer decides the tokens
        if not job.sentences:
            raise UsageError("no sentence given", fix="pass one or more sentences, or --file FILE")
        _check_sentence(job, len(job.sentences))
        report(f"loading the model and running it on {_count(len(job.sentences), 'sentence')}")
        attention_run = run_model(
            job.model, job.sentences, job.layer, job.device, job.dtype, job.device_map,
            job.max_tokens, job.head is not None or job.average, job.max_panels,
            keep_full_maps=job.keep_full_maps,
            query=None if job.query is None else (job.sentence - 1, job.query),
            targets=job.targets, export_path=job.export_path, memory_budget=job.memory_budget)
    else:
        batch = make_batch(job.sentences, job.max_tokens, job.max_sentences)
        _check_sentence(job, len(batch.tokens))
        query_row = None
        if job.query is not None:  # fail before any work
            query_row = job.sentence - 1, find_query(batch.tokens[job.sentence - 1], job.query)
        report(f"running attention on {_count(len(batch.tokens), 'sentence')} "
               f"({_count(sum(batch.lengths), 'token')})")
        attention_run = run(HeatmapRequest(
            batch, job.weights, job.layer, job.random, job.hints, job.causal, job.positions,
            job.device, keep_full_maps=job.keep_full_maps, export_path=job.export_path,
            memory_budget=job.memory_budget, query_row=query_row, max_panels=job.max_panels,
            panels_per_map=1 if job.head is not None or job.average else None), warnings.append)
    report("computing head statistics")
    result = summarize(attention_run, job.head, job.average, job.query, job.sentence - 1)
    result.warnings = warnings
    return result


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
    if head is not None:  # --head shows one head: its statistics alone, as its map
        head_stats = [s for s in head_stats if s.head == head]
    selected = maps.select_maps(attention_run, head, average)
    breakdown = None
    if query is not None:
        last = attention_run.layers[-1]
        query_index = find_query(last.rows_of(batch)[sentence_index], query)
        breakdown = query_breakdown(attention_run, last.index, sentence_index, query_index)
    return HeatmapResult(attention_run, head_stats, selected, breakdown)
