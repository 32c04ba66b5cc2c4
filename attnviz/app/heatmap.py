"""`attnviz heatmap`: choose the weights, build the batch, run attention, export.

Sources: the bundled attention-only model (default), one layer of a checkpoint (`--weights`), or a
randomly initialized nn.MultiheadAttention (`--random`)."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
        for line in head_hint_warnings(store, request, layer):
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
EXPORT_NAMES = {"self": ("attn", "inputs"), "decoder-self": ("decoder", "inputs.decoder"),
                "cross": ("cross", "inputs.cross")}


def export_key(captured: Any) -> tuple[str, str]:
    """(maps key, inputs key) of a layer: attn.N / inputs.N, decoder.N / inputs.decoder.N and
    cross.N / inputs.cross.N, N its number within its stack."""
    maps, inputs = EXPORT_NAMES[captured.kind]
    number = captured.display_label.split()[-1]
    return f"{maps}.{number}", f"{inputs}.{number}"


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
    """attn.{layer} (B, H, L, S), inputs.{layer} (B, L, E) where captured, mask (B, L),
    metadata tokens; with a decoder run also decoder.{layer} (B, H, T, T), cross.{layer}
    (B, H, T, S), inputs.decoder.{layer} / inputs.cross.{layer}, target_mask (B, T) and
    metadata target_tokens."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from attnviz.app.outputs import atomic_output, check_free_space
    from attnviz.compute.inputs import padding_mask

    if run.exported == path:  # a streamed run wrote the file as it went
        return
    tensors = {"mask": (~padding_mask(run.batch)).to(torch.int64).contiguous()}
    metadata = _export_metadata(run.batch, run.source, run.inputs_described, run.causal)
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
    check_free_space(path, sum(t.numel() * t.element_size() for t in tensors.values()))
    with atomic_output(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError:  # the writer's own I/O error (a full disk, a size limit)
            raise OSError(errno.EIO, "the safetensors writer failed (a full disk or a file "
                          "size limit?)") from None


def _export_metadata(batch: Batch, source: str, inputs: str, causal: bool) -> dict[str, str]:
    return {"tokens": json.dumps(batch.tokens), "source": source, "inputs": inputs,
            "causal": str(causal).lower()}


class StreamedExport:
    """The --export file of a streamed standalone layer, written as the maps are computed: the
    safetensors header first (every shape is known before the run), then the mask, the inputs
    and attn.N (B, H, L, S) row block by row block in layout order, so that no full map is
    ever held. Rows are laid out as `export` lays out the full maps: real keys, zeros at padded
    keys (and at keys a causal block never computed), then the bias_k column; padded queries'
    rows are computed like any other (as torch does)."""

    def __init__(self, file: Any, batch: Batch, num_heads: int, extra_keys: int, source: str,
                 causal: bool, index: int = 0) -> None:
        self.file, self.batch, self.heads = file, batch, num_heads
        self.maps_key, self.inputs_key = f"attn.{index}", f"inputs.{index}"  # as `export` names
        self.source, self.causal = source, causal
        self.width = batch.max_len + extra_keys
        self._next = (0, 0, 0)  # the (sentence, head, row) the file expects next
        self._row_buf: Any = None

    def begin(self, inputs_described: str, inputs: Any) -> None:
        import struct

        import torch

        from attnviz.compute.inputs import padding_mask

        B, L = len(self.batch.tokens), self.batch.max_len
        mask = (~padding_mask(self.batch)).to(torch.int64).contiguous()
        x = inputs.float().contiguous()
        sizes = {"mask": mask.numel() * 8, self.inputs_key: x.numel() * 4,
                 self.maps_key: B * self.heads * L * self.width * 4}
        shapes = {"mask": ["I64", [B, L]], self.inputs_key: ["F32", list(x.shape)],
                  self.maps_key: ["F32", [B, self.heads, L, self.width]]}
        header: dict[str, Any] = {"__metadata__": _export_metadata(
            self.batch, self.source, inputs_described, self.causal)}
        offset = 0
        for name in ("mask", self.inputs_key, self.maps_key):  # the data's order in the file
            dtype, shape = shapes[name]
            header[name] = {"dtype": dtype, "shape": shape,
                            "data_offsets": [offset, offset + sizes[name]]}
            offset += sizes[name]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.write(mask.numpy().data)
        self.file.write(x.numpy().data)

    def rows(self, sentence: int, head: int, row_start: int, attn: Any, keys: int) -> None:
        """attn (r, keys + extra) on any device: rows row_start.. of (sentence, head)."""
        import torch

        if (sentence, head, row_start) != self._next:
            raise ValueError(f"rows {(sentence, head, row_start)} arrived out of order; "
                             f"expected {self._next}")
        r, L = attn.shape[0], self.batch.max_len
        if self._row_buf is None or self._row_buf.shape[0] < r:
            self._row_buf = torch.empty(r, self.width)
        out = self._row_buf[:r]
        out[:, :keys] = attn[:, :keys]
        out[:, keys:L] = 0.0
        out[:, L:] = attn[:, keys:]
        self.file.write(out.numpy().data)
        row = row_start + r
        if row < L:
            self._next = (sentence, head, row)
        elif head + 1 < self.heads:
            self._next = (sentence, head + 1, 0)
        else:
            self._next = (sentence + 1, 0, 0)

    def close(self) -> None:
        if self._next != (len(self.batch.tokens), 0, 0):
            raise ValueError(f"the export stopped at {self._next}")


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
    if store is None:  # a model run: the layers were captured from the model itself
        name = display_name(run.source)
    elif is_tiny_model(store):
        name = "the bundled induction model"
    elif store.format == "random init":
        name = run.source
    else:
        name = display_name(run.source)
        kind = store.config.get("model_type")
        name += f" ({kind})" if isinstance(kind, str) else ""
    indices = [captured.index for captured in run.layers]
    labels = [captured.display_label for captured in run.layers]
    if len(indices) == 1:
        shown = run.layers[0].display_name
        where = f"layer {labels[0]}" + (f" ({shown})" if shown else "")
    elif labels != [str(i) for i in indices]:  # an encoder-decoder's stacks: enc 0, cross 1, …
        where = "layers " + ", ".join(labels)
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
            targets=job.targets)
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
