"""`attnviz heatmap`: choose the weights, build the batch, run attention, export.

Sources: the bundled attention-only model (default), one layer of a checkpoint (`--weights`), or a
randomly initialized nn.MultiheadAttention (`--random`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
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


def run(request: HeatmapRequest, warn: Callable[[str], None] | None = None) -> Any:
    """The AttentionRun for a request (all checks before any tensor is allocated); `warn`
    hears what the caller should know but that does not stop the run."""
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
    if warn is not None and request.hints.num_heads is not None:
        for line in head_hint_warnings(store, request, layer):
            warn(line)
    attention_run = run_layer(layer, store, request.batch, request.causal or layer.causal,
                              request.positions, device, store, not request.keep_full_maps,
                              request.query_row)
    index = inventory.layers.index(layer)
    renumber(attention_run, index)
    attention_run.notes.insert(0, synthetic_note(store, request.weights, index))
    return attention_run


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt",
                   "vocab.json", "sentencepiece.bpe.model")
HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")


def renumber(attention_run: Any, index: int) -> None:
    """A standalone layer runs alone; its maps, statistics and export keys carry the index
    `inspect` gives it in its checkpoint (`--layer 3` shows L3), not 0."""
    from dataclasses import replace

    for captured in attention_run.layers:
        captured.index = index
        if captured.views is not None:
            captured.views = [replace(view, layer=index) for view in captured.views]
        if captured.stats is not None:
            captured.stats = [replace(stat, layer=index) for stat in captured.stats]


def model_folder(store: Any, weights: Path | None) -> Path | None:
    """The folder that `--model` could load instead: config.json and tokenizer files."""
    folder = store.folder or (None if weights is None else
                              weights if weights.is_dir() else weights.parent)
    if folder is None or not (folder / "config.json").is_file():
        return None
    return folder if any((folder / name).is_file() for name in TOKENIZER_FILES) else None


def synthetic_note(store: Any, weights: Path | None, index: int) -> str:
    """Plain words for what a standalone layer's maps are, and where the real ones come from."""
    import shlex

    from attnviz.errors import printable

    note = (f"synthetic inputs: these maps are layer {index}'s weights applied to the vectors "
            "above, not to the hidden states the model feeds that layer, so they are not the "
            "model's own attention")
    folder = model_folder(store, weights)
    if folder is not None:
        note += (f"; for that, run the model: attnviz heatmap --model "
                 f"{shlex.quote(printable(str(folder), 200))} …")
    return note


def head_hint_warnings(store: Any, request: HeatmapRequest, chosen: Any) -> list[str]:
    """-H that disagrees with the checkpoint's own head count (config.json or metadata)."""
    from attnviz.errors import AttnvizError, printable
    from attnviz.recognize import find_layers, select_layer

    hints = request.hints
    try:
        own = select_layer(find_layers(store, HeadHints(None, hints.num_kv_heads,
                                                        hints.head_dim)),
                           request.layer, store.source)
    except AttnvizError:
        return []
    if not own.heads_known or own.num_heads == hints.num_heads:
        return []
    key = next((k for k in HEADS_KEYS if isinstance(store.config.get(k), int)), None)
    said = f"config.json's {key} = {store.config[key]}" if key else \
        f"the checkpoint's own {own.num_heads}"
    return [f"-H {hints.num_heads} disagrees with {said} for layer "
            f"{printable(chosen.name)!r}: the maps split it into {hints.num_heads} heads of "
            f"d = {chosen.head_dim}, not the model's {own.num_heads} heads"]


def export(run: Any, path: Path) -> None:
    """attn.{layer} (B, H, L, S), inputs.{layer} (B, L, E), mask (B, L), metadata tokens."""
    import torch
    from safetensors.torch import save_file

    from attnviz.app.outputs import atomic_output
    from attnviz.compute.inputs import padding_mask

    tensors = {"mask": (~padding_mask(run.batch)).to(torch.int64).contiguous()}
    for captured in run.layers:
        tensors[f"attn.{captured.index}"] = captured.weights.float().contiguous()
        tensors[f"inputs.{captured.index}"] = captured.inputs.float().contiguous()
    metadata = {"tokens": json.dumps(run.batch.tokens), "source": run.source,
                "inputs": run.inputs_described, "causal": str(run.causal).lower()}
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


GENERIC_NAMES = ("model", "models", "checkpoint", "checkpoints", "weights", "final")
GENERIC_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")


def display_name(source: str) -> str:
    """A model's name from its path: the folder (a hub snapshot's repository id), the file's
    name when it says more than 'model.safetensors', a generic folder with its parent."""
    path = Path(source)
    if path.name in GENERIC_FILES:
        path = path.parent
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    if path.name.lower() in GENERIC_NAMES and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name or source


def run_title(run: Any) -> str:
    from attnviz.sources.bundled import is_tiny_model

    store = run.store
    if is_tiny_model(store):
        name = "the bundled induction model"
    elif store.format == "random init":
        name = run.source
    else:
        name = display_name(run.source)
        kind = store.config.get("model_type")
        name += f" ({kind})" if isinstance(kind, str) else ""
    indices = [captured.index for captured in run.layers]
    if len(indices) == 1:
        layer = run.layers[0].layer
        where = f"layer {indices[0]}" + (f" ({layer.name})" if layer.name else "")
    elif indices == list(range(indices[0], indices[-1] + 1)):
        where = f"layers {indices[0]}–{indices[-1]}"
    else:
        where = "layers " + ", ".join(map(str, indices))
    return f"{name} · {where}"


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
            query=None if job.query is None else (job.sentence - 1, job.query))
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
            job.device, keep_full_maps=job.keep_full_maps, query_row=query_row,
            max_panels=job.max_panels,
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
        maps.check_head(head, captured.layer.num_heads or 0)
    check_finite_maps(attention_run)
    head_stats = [s for captured in attention_run.layers for s in (
        captured.stats if captured.weights is None else stats_mod.head_stats(
            captured.weights, attention_run.batch.tokens, captured.index))]
    if head is not None:  # --head shows one head: its statistics alone, as its map
        head_stats = [s for s in head_stats if s.head == head]
    selected = maps.select_maps(attention_run, head, average)
    breakdown = None
    if query is not None:
        query_index = find_query(attention_run.batch.tokens[sentence_index], query)
        layer_index = attention_run.layers[-1].index
        breakdown = query_breakdown(attention_run, layer_index, sentence_index, query_index)
    return HeatmapResult(attention_run, head_stats, selected, breakdown)
