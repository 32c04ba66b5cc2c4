"""The public Python API, for notebooks and scripts: the same use cases the commands run.

    import attnviz
    result = attnviz.split(embed_dim=32, num_heads=4)        # random nn.MultiheadAttention
    result.report.proof.passed, result.figure()
    heat = attnviz.run_heatmap(["the cat sat on the mat the cat sat"])   # the bundled model
    heat.head_stats[0], heat.views[0].values, heat.figure()

Results display themselves in Jupyter (`_repr_html_`: the interactive view; `_repr_png_`).
Every function raises `attnviz.AttnvizError` (`.what`, `.fix`) for a mistake the caller can fix;
its messages name options by their keyword (`max_tokens`), never by a command-line flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from attnviz.app.circuits import CircuitsRequest, run_circuits
from attnviz.app.heatmap import HeatmapResult
from attnviz.app.heatmap import run_heatmap as _run_heatmap
from attnviz.app.inspect_checkpoint import InspectRequest, InspectResult, inspect_checkpoint
from attnviz.app.split import SplitRequest, SplitResult, run_split
from attnviz.compute.logit.attribute_result import AttributeResult
from attnviz.compute.logit.lens_result import LensResult
from attnviz.compute.patching.result import PatchResult
from attnviz.compute.qkov.circuits_result import CircuitsResult
from attnviz.compute.tokenflow.token_result import TokensResult
from attnviz.core.choices import AblationMode, ColorScale, Dtype, OverviewShows, Weighting
from attnviz.core.request import (
    DEFAULT_MAX_SENTENCES,
    DEFAULT_MAX_TOKENS,
    MAX_SEED,
    HeadHints,
    HeatmapRequest,
    LayerOptions,
)
from attnviz.errors import UsageError, option
from attnviz.load.checkpoint import open_checkpoint as _open_checkpoint
from attnviz.load.store import TensorStore
from attnviz.recognize import Inventory

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from matplotlib.figure import Figure

    from attnviz.compute.comparison.compare_result import CompareResult
    from attnviz.compute.measures.overview import Overview

_T = TypeVar("_T")


def _png(figure: Figure) -> bytes:
    from attnviz.render.figure_io import isolated_rc, png_bytes

    with isolated_rc():
        return png_bytes(figure)


class Split(SplitResult):
    """A layer's head split and proof (`report`), with a figure of W_q, W_k, W_v, W_o."""

    def figure(self) -> Figure:
        """A matplotlib Figure of the four matrices with head boundaries."""
        from attnviz.render.split_figure import split_figure

        return split_figure(self.matrix_panels(), self.title)

    def _repr_png_(self) -> bytes:
        return _png(self.figure())


class Heatmap(HeatmapResult):
    """Attention maps (`views`), head statistics (`head_stats`) and the run they came from."""

    def figure(self, scale: str = ColorScale.MAX, size: float | None = None,
               dpi: int | None = None) -> Figure:
        """A matplotlib Figure: a grid of the selected maps, one row per sentence and layer
        (`scale` max|fixed|log, `size` the side of a panel in inches, as the CLI's options)."""
        from attnviz.render.heatmap_output import run_figure_of

        return run_figure_of(self, ColorScale.parse(scale, "scale"), size, dpi)

    def overview(self, shows: str = OverviewShows.LABEL) -> Overview:
        """The layers × heads grid (`shows`: label, a statistic, or ablation), as --overview."""
        return super().overview(OverviewShows.parse(shows, "overview"))

    def ablation_figure(self) -> Figure:
        """The causal head scorecard (`ablate=`): a layers × heads heatmap per measure."""
        from attnviz.errors import UsageError
        from attnviz.render.ablation_figure import ablation_figure

        if self.ablation is None:
            raise UsageError(f"no scorecard: this run was made without {option('ablate')}",
                             fix="pass ablate='zero' or 'mean'", option="ablate")
        return ablation_figure(self.ablation, self.head_stats, self.title())

    def _repr_png_(self) -> bytes:
        return _png(self.figure())

    def html(self) -> str:
        """The interactive page `--html` writes: one self-contained file, no network."""
        from attnviz.render.html import render_html

        return render_html(self._document())

    def _repr_html_(self) -> str:
        """Jupyter: the interactive page inline (an iframe; it needs no internet)."""
        from attnviz.render.html import notebook_html

        return notebook_html(self._document())

    def _document(self) -> dict[str, Any]:
        """The page's document, its notes naming options by keyword (`export`)."""
        from attnviz.render.heatmap_output import page_document

        return page_document(self)


def _as(cls: type[_T], result: DataclassInstance) -> _T:
    return cls(**{f.name: getattr(result, f.name) for f in fields(result)})


# --- arguments checked as the command line checks them (keyword names, not flags) ----------


def _texts(value: object, name: str, allow_none: bool = False) -> list[str] | None:
    """A sequence of texts: a bare string, bytes or an array is a TypeError, not letters."""
    if value is None and allow_none:
        return None
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of strings, not {type(value).__name__}"
                        + (f" (wrap it: {name}=[...])" if isinstance(value, str) else ""))
    texts = list(value)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{index}] must be a str, not {type(text).__name__}")
    return texts


def _int(value: object, name: str, low: int | None = None, allow_none: bool = False,
         high: int | None = None) -> int | None:
    """An integer keyword (numpy integers accepted, bools and floats refused), in range."""
    import operator

    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    number = operator.index(value)
    if low is not None and number < low:
        bound = "a positive integer" if low == 1 else f">= {low}"
        raise UsageError(f"{option(name)} must be {bound}"
                         f", got {number}", option=name)
    if high is not None and number > high:
        raise UsageError(f"{option(name)} must be {low or 0}..{high}, not {number}", option=name)
    return int(number)


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {type(value).__name__}")
    return value


def _str(value: object, name: str, allow_none: bool = True, ints: bool = False) -> str | None:
    """A text keyword (`ints`: an int is accepted too, as for layer and query)."""
    if value is None and allow_none:
        return None
    if ints and not isinstance(value, bool) and hasattr(value, "__index__"):
        return str(_int(value, name))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    return value


def _path(value: object, name: str) -> Path | None:
    import os

    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or isinstance(value, bytes):
        raise TypeError(f"{name} must be a str or a path, not {type(value).__name__}")
    return Path(value)


def _number(value: object, name: str) -> float:
    """A real-valued keyword (ints accepted, bools and strings refused); its range is the
    caller's to check."""
    import math

    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise UsageError(f"{option(name)} must be a finite number, got {value}", option=name)
    return float(value)


def _ablate(value: object) -> AblationMode | None:
    return None if value is None else AblationMode.parse(value, "ablate")


def _sizes(embed_dim: object = None, num_heads: object = None, num_kv_heads: object = None,
           head_dim: object = None, kdim: object = None, vdim: object = None,
           bias: object = True, seed: int | None = None) -> LayerOptions:
    """A layer's sizes and head counts, each checked (0 or less is refused, never defaulted),
    for `LayerOptions.build`: the random layer and head hints, built as the commands build
    them."""
    def size(value: object, name: str) -> int | None:
        return _int(value, name, 1, True)

    return LayerOptions(size(embed_dim, "embed_dim"), size(num_heads, "num_heads"),
                        size(num_kv_heads, "num_kv_heads"), size(head_dim, "head_dim"),
                        size(kdim, "kdim"), size(vdim, "vdim"), _flag(bias, "bias"), seed)


def _hints(num_heads: object, num_kv_heads: object, head_dim: object) -> HeadHints:
    return HeadHints(_int(num_heads, "num_heads", 1, True),
                     _int(num_kv_heads, "num_kv_heads", 1, True),
                     _int(head_dim, "head_dim", 1, True))


def open_checkpoint(path: str | Path) -> TensorStore:
    """A checkpoint file or folder, headers read, tensors read on demand."""
    return _open_checkpoint(_path(path, "path") or Path())


def find_layers(checkpoint: str | Path | TensorStore, *, num_heads: int | None = None,
                num_kv_heads: int | None = None, head_dim: int | None = None) -> Inventory:
    """Every attention layer attnviz recognizes in a checkpoint (headers only)."""
    hints = _hints(num_heads, num_kv_heads, head_dim)
    store = checkpoint if isinstance(checkpoint, TensorStore) else open_checkpoint(checkpoint)
    from attnviz.sources.registry import find_inventory

    return find_inventory(store, hints)  # as inspect and every command list them


def inspect(checkpoint: str | Path, *, layer: str | int | None = None,
            num_heads: int | None = None, num_kv_heads: int | None = None,
            head_dim: int | None = None, scan: bool = False) -> InspectResult:
    """What `attnviz inspect` reports, as a document (`.doc`) and per-head detail (`.detail`)."""
    return inspect_checkpoint(InspectRequest(
        _path(checkpoint, "checkpoint") or Path(), _str(layer, "layer", ints=True),
        _hints(num_heads, num_kv_heads, head_dim), _flag(scan, "scan")))


def split(weights: str | Path | None = None, *, model: str | None = None,
          layer: str | int | None = None, embed_dim: int | None = None,
          num_heads: int | None = None, num_kv_heads: int | None = None,
          head_dim: int | None = None, kdim: int | None = None, vdim: int | None = None,
          bias: bool = True, seed: int = 0, verify: bool = False) -> Split:
    """How the heads split one layer, proved against torch's forward (`verify`: against the
    model itself). Without weights or model: a random nn.MultiheadAttention(embed_dim, ...)."""
    seed = _int(seed, "seed", 0, high=MAX_SEED) or 0
    checkpoint = weights is not None or model is not None
    if checkpoint and not _flag(bias, "bias"):  # a checkpoint's biases are its own
        raise UsageError(f"{option('bias')}=False applies to a random layer only",
                         fix="drop it, or pass neither weights nor model", option="bias")
    # the seed draws split's proof batch too: a checkpoint takes it
    random, hints = _sizes(embed_dim, num_heads, num_kv_heads, head_dim, kdim, vdim, bias,
                           seed).build(not checkpoint, "a random layer only",
                                       "drop {them}, or pass neither weights nor model",
                                       seed_is_random=False)
    result = run_split(SplitRequest(
        _path(weights, "weights"), _str(model, "model"), _str(layer, "layer", ints=True),
        hints, random, seed, _flag(verify, "verify")))
    return _as(Split, result)


def run_heatmap(sentences: Sequence[str], *, weights: str | Path | None = None,
                random: bool = False, layer: str | int | None = None,
                head: int | None = None, average: bool = False, query: str | int | None = None,
                sentence: int = 1, causal: bool = False, device: str = "auto",
                embed_dim: int | None = None, num_heads: int | None = None,
                seed: int = 0, keep_full_maps: bool = False,
                max_tokens: int = DEFAULT_MAX_TOKENS,
                max_sentences: int = DEFAULT_MAX_SENTENCES, weighting: str = "attention",
                ablate: str | None = None) -> Heatmap:
    """Attention of the bundled model (default), one checkpoint layer (`weights`) or a random
    nn.MultiheadAttention (`random=True`) on a padded batch of sentences. `weighting="norm"`:
    value-weighted maps ‖α·W_O v‖ (rows normalized); `ablate="zero"|"mean"`: the causal head
    scorecard (`.ablation`, `.ablation_figure()`)."""
    seed = _int(seed, "seed", 0, high=MAX_SEED) or 0
    # the random init's seed: nothing else here draws (0, the default, is not given)
    spec, hints = _sizes(embed_dim, num_heads, seed=seed or None).build(
        _flag(random, "random"), "a random layer only", "drop {them}, or pass random=True")
    request = HeatmapRequest.build(  # the request the CLI builds, from the same names
        sentences=tuple(_texts(sentences, "sentences") or ()), weights=_path(weights, "weights"),
        random=spec, layer=_str(layer, "layer", ints=True),
        hints=hints,
        causal=_flag(causal, "causal"), device=_str(device, "device", False) or "",
        head=_int(head, "head", 0, True), average=_flag(average, "average"),
        query=_str(query, "query", ints=True), sentence=_int(sentence, "sentence", 1) or 1,
        keep_full_maps=_flag(keep_full_maps, "keep_full_maps"),
        max_tokens=_int(max_tokens, "max_tokens", 1) or 1,
        max_sentences=_int(max_sentences, "max_sentences", 1) or 1,
        weighting=Weighting.parse(weighting, "weighting"), ablate=_ablate(ablate))
    return _as(Heatmap, _run_heatmap(request))


def run_model(model: str | Path, sentences: Sequence[str], *, layer: str | int | None = None,
              head: int | None = None, average: bool = False, query: str | int | None = None,
              sentence: int = 1, device: str = "auto", dtype: str = "float32",
              keep_full_maps: bool = False, targets: Sequence[str] | None = None,
              max_tokens: int = DEFAULT_MAX_TOKENS,
              max_sentences: int = DEFAULT_MAX_SENTENCES, weighting: str = "attention",
              ablate: str | None = None, generate: int | None = None,
              sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
              seed: int = 0) -> Heatmap:
    """A Hugging Face model's own attention (needs the `attnviz[hf]` extra; never downloads);
    `targets` (one per sentence) run an encoder-decoder model's decoder too; `weighting` and
    `ablate` as in `run_heatmap`. `generate=N`: the model (with its language-model head)
    writes up to N tokens after each sentence, greedy unless `sample` (with `temperature`,
    `top_p`, `seed`); the maps then cover prompt + generated tokens, and `.generation` says
    what was written."""
    from attnviz.app.generate import generate_spec

    # checked as the CLI checks --generate, --sample, --temperature, --top-p and --seed: a
    # sampling option without generate (or sample) is refused, never ignored
    temperature, top_p = _number(temperature, "temperature"), _number(top_p, "top_p")
    seed = _int(seed, "seed", 0, high=MAX_SEED) or 0
    spec = generate_spec(None if generate is None else _int(generate, "generate", 0),
                         _flag(sample, "sample"), None if temperature == 1.0 else temperature,
                         None if top_p == 1.0 else top_p, seed or None)
    if spec is None and seed:
        raise UsageError(f"{option('seed')} applies to {option('generate')} with "
                         f"{option('sample')} only", fix=f"drop {option('seed')}", option="seed")
    targets_given = _texts(targets, "targets", allow_none=True)
    request = HeatmapRequest.build(
        sentences=tuple(_texts(sentences, "sentences") or ()),
        model=str(_path(model, "model")), layer=_str(layer, "layer", ints=True),
        device=_str(device, "device", False) or "", dtype=Dtype.parse(dtype, "dtype"),
        head=_int(head, "head", 0, True), average=_flag(average, "average"),
        query=_str(query, "query", ints=True), sentence=_int(sentence, "sentence", 1) or 1,
        keep_full_maps=_flag(keep_full_maps, "keep_full_maps"),
        targets=None if targets_given is None else tuple(targets_given),
        max_tokens=_int(max_tokens, "max_tokens", 1) or 1,
        max_sentences=_int(max_sentences, "max_sentences", 1) or 1,
        weighting=Weighting.parse(weighting, "weighting"), ablate=_ablate(ablate),
        generate=spec)
    return _as(Heatmap, _run_heatmap(request))


class Circuits(CircuitsResult):
    """Every head's QK and OV circuit (`layers[i].heads`) and Q-, K-, V-composition
    (`compositions`); `to_json()` is the `--json` document."""

    def figure(self) -> Figure:
        """Singular values per head, and the three composition heatmaps."""
        from attnviz.render.circuits_figure import circuits_figure

        return circuits_figure(self)

    def _repr_png_(self) -> bytes:
        return _png(self.figure())

    def _repr_html_(self) -> str:
        from attnviz.render.circuits_html import circuits_html

        return circuits_html(self)


def circuits(weights: str | Path | None = None, *, model: str | Path | None = None,
             layer: str | int | None = None, random: bool = False,
             embed_dim: int | None = None, num_heads: int | None = None,
             num_kv_heads: int | None = None, head_dim: int | None = None,
             kdim: int | None = None, vdim: int | None = None, seed: int = 0,
             composition: bool | None = None, device: str = "cpu") -> Circuits:
    """QK and OV circuits of every head and composition between layers, of the bundled model
    (default), a checkpoint (`weights`), a Hugging Face folder (`model`) or a random
    nn.MultiheadAttention (`random=True`)."""
    seed = _int(seed, "seed", 0, high=MAX_SEED) or 0
    spec, hints = _sizes(embed_dim, num_heads, num_kv_heads, head_dim, kdim, vdim,
                         seed=seed or None).build(_flag(random, "random"), "a random layer only",
                                                  "drop {them}, or pass random=True")
    result = run_circuits(CircuitsRequest(
        _path(weights, "weights"), _str(model, "model"), _str(layer, "layer", ints=True),
        hints, spec, None if composition is None else _flag(composition, "composition"),
        _str(device, "device", allow_none=False) or "cpu"))
    return _as(Circuits, result)


def patch(clean: str | None = None, *, corrupt: str | None = None, answer: str | None = None,
          wrong: str | None = None, pairs: str | Path | None = None,
          model: str | Path | None = None, metric: str = "logit-diff",
          directions: Sequence[str] = ("denoising",), sites: Sequence[str] = ("heads",
                                                                               "residual"),
          per_position: bool | None = None, receivers: str | None = None,
          receiver_input: str | None = None, device: str = "auto", dtype: str = "float32",
          memory_budget: int | None = None, target: str | None = None) -> PatchResult:
    """Activation patching (`attnviz patch`): a clean prompt, its `corrupt` twin, the
    `answer` (and `wrong` one, for the logit difference), or many `pairs` from a TSV / JSON-lines
    file; nothing given: the bundled model's built-in induction pair; an encoder-decoder `model`
    takes the decoder's prefix as `target`. Returns the baselines and
    one grid of effects per sweep (`grids`; `to_json()` is the `--json` document)."""
    from attnviz.app.patch import PatchRequest, run_patch
    from attnviz.core.choices import PatchDirection, PatchMetric, PatchSite

    request = PatchRequest(
        _str(clean, "clean"), _str(corrupt, "corrupt"), _str(answer, "answer"),
        _str(wrong, "wrong"), _path(pairs, "pairs"), _str(model, "model"),
        PatchMetric.parse(metric, "metric"),
        tuple(PatchDirection.parse(d, "directions") for d in _texts(directions, "directions")
              or ()),
        tuple(PatchSite.parse(s, "sites") for s in _texts(sites, "sites") or ()),
        None if per_position is None else _flag(per_position, "per_position"),
        _str(receivers, "receivers"),
        None if receiver_input is None else PatchSite.parse(receiver_input, "receiver_input"),
        _str(device, "device", False) or "auto", Dtype.parse(dtype, "dtype"),
        _int(memory_budget, "memory_budget", 1, True), _str(target, "target"))
    if not request.directions or not request.sites:
        raise UsageError(f"{option('directions')} and {option('sites')} need a value each",
                         fix="leave them at their defaults")
    return run_patch(request)


def attribute(prompts: Sequence[str] = (), *, model: str | Path | None = None,
              answer: str | None = None, wrong: str | None = None, position: int = -1,
              corrupt: Sequence[str] = (), pairs: str | Path | None = None,
              targets: Sequence[str] = (), top: int = 10, device: str = "auto",
              dtype: str = "float32") -> AttributeResult:
    """Direct logit attribution (`attnviz attribute`): each head's, each layer's and the
    embeddings' direct contribution to logit(answer) − logit(wrong) (or logit(answer)), the
    final norm's scale frozen; the parts add up to the model's own metric (`parts.remainder`).
    `pairs`: a TSV / JSON-lines file of prompt pairs; `targets`: an encoder-decoder's decoder
    texts. Default: the bundled model on its built-in induction prompt."""
    from attnviz.app.attribute import AttributeRequest, run_attribute

    return run_attribute(AttributeRequest(
        _texts(prompts, "prompts") or [], str(_path(model, "model")) if model else None,
        _str(answer, "answer"), _str(wrong, "wrong"), _int(position, "position") or 0,
        _texts(corrupt, "corrupt") or [], _path(pairs, "pairs"),
        device=_str(device, "device", False) or "auto", dtype=Dtype.parse(dtype, "dtype"),
        top=_int(top, "top", 1) or 1, targets=_texts(targets, "targets") or []))


def lens(prompts: Sequence[str] = (), *, model: str | Path | None = None,
         answer: str | None = None, positions: Sequence[int] = (), top: int = 3,
         targets: Sequence[str] = (), device: str = "auto",
         dtype: str = "float32") -> LensResult:
    """The logit lens (`attnviz lens`): per layer × position, the top tokens and the answer's
    rank and probability, each layer's residual through the model's own final norm (its own
    statistics) and unembedding. Default: the bundled model on its built-in prompt."""
    from attnviz.app.lens import LensRequest, run_lens

    if isinstance(positions, str | bytes) or not isinstance(positions, Sequence):
        raise TypeError(f"positions must be a list of ints, not {type(positions).__name__}")
    return run_lens(LensRequest(
        _texts(prompts, "prompts") or [], str(_path(model, "model")) if model else None,
        _str(answer, "answer"), [_int(p, "positions") or 0 for p in positions],
        _int(top, "top", 1) or 1, _str(device, "device", False) or "auto",
        Dtype.parse(dtype, "dtype"), _texts(targets, "targets") or []))
def tokens(sentences: Sequence[str], *, model: str | Path | None = None,
           position: str | int | None = None, methods: Sequence[str] | None = None,
           heads: str = "mean", residual_weight: float = 0.5, check: bool = True,
           erase: str = "mask", baseline: str | None = None, memory_budget: int | None = None,
           max_tokens: int = DEFAULT_MAX_TOKENS, max_sentences: int = DEFAULT_MAX_SENTENCES,
           device: str = "cpu", dtype: str = "float32",
           targets: Sequence[str] | None = None) -> TokensResult:
    """Which input tokens reach one output position through all layers, on the bundled model
    (default) or a Hugging Face folder (`model`): attention rollout, attention flow, norms and
    ALTI side by side (`result.sentences[i].chains[method]`, the matrices, the leave-one-out
    effects) and each method's rank correlation with erasure (`result.summary`). `targets`
    (an encoder-decoder `model`, one per sentence): the decoder's view of the source, as
    `--target` (`result.sentences[i].output_tokens`, `.decoder_shares`)."""
    from attnviz.app.tokens import TokensRequest, run_tokens
    from attnviz.core.choices import Erase, HeadReduce, TokenMethod

    texts = _texts(sentences, "sentences") or []
    chosen = None if methods is None else tuple(
        TokenMethod.parse(m, "method") for m in _texts(methods, "methods") or [])
    budget = _int(memory_budget, "memory_budget", 1, True)
    return run_tokens(TokensRequest(
        texts, None if model is None else str(_path(model, "model")),
        _str(position, "position", ints=True), chosen, HeadReduce.parse(heads, "heads"),
        _number(residual_weight, "residual_weight"), _flag(check, "check"),
        Erase.parse(erase, "erase"), _str(baseline, "baseline"), budget,
        _int(max_tokens, "max_tokens", 1) or DEFAULT_MAX_TOKENS,
        _int(max_sentences, "max_sentences", 1) or DEFAULT_MAX_SENTENCES,
        _str(device, "device", allow_none=False) or "cpu", Dtype.parse(dtype, "dtype"),
        None if targets is None else tuple(_texts(targets, "targets") or [])))


def corpus(path: str | Path, *, model: str | Path | None = None, field: str | None = None,
           limit: int | None = None, sample: int | None = None, seed: int = 0,
           long: str = "truncate", weighting: str = "attention", max_tokens: int = 128,
           device: str = "auto", dtype: str = "float32", resamples: int = 200,
           state: str | Path | None = None, resume: bool = False) -> Any:
    """Head statistics over a corpus (`attnviz corpus`): a text file with one example per line,
    JSON lines (`field`), streamed; the bundled model (default) or a Hugging Face `model`.
    Returns the CorpusResult: `.summary.heads` (each statistic's mean with its 95 % interval
    over examples, the type, its stability and settle point), `.to_json()`, `.rows()`."""
    from attnviz.app.corpus import CorpusRequest, run_corpus
    from attnviz.core.choices import LongExamples
    from attnviz.errors import with_options

    result = run_corpus(CorpusRequest(
        _path(path, "path") or Path("-"),
        _str(str(model) if isinstance(model, Path) else model, "model"), _str(field, "field"),
        _str(device, "device", False) or "auto", Dtype.parse(dtype, "dtype"),
        weighting=Weighting.parse(weighting, "weighting"),
        max_tokens=_int(max_tokens, "max_tokens", 1) or 1,
        long=LongExamples.parse(long, "long"), limit=_int(limit, "limit", 1, True),
        sample=_int(sample, "sample", 1, True), seed=_int(seed, "seed", 0, high=MAX_SEED) or 0,
        resamples=_int(resamples, "resamples", 1) or 1, state=_path(state, "state"),
        resume=_flag(resume, "resume")))
    result.notes = [with_options(note) for note in result.notes]  # keywords, as errors say
    return result


def compare(against: str | Path, *, model: str | Path | None = None,
            weights: str | Path | None = None, corpus: str | Path | None = None,
            field: str | None = None, limit: int | None = None, sample: int | None = None,
            seed: int = 0, long: str = "truncate", max_tokens: int = 128,
            weighting: str = "attention", device: str = "auto", dtype: str = "float32",
            num_heads: int | None = None, num_kv_heads: int | None = None,
            head_dim: int | None = None) -> CompareResult:
    """Model A (`model`, a Hugging Face folder; or `weights`, a checkpoint) against model B
    (`against`) head by head, as `attnviz compare` does: `.weights` says which heads are
    byte-identical and how far the others moved; with `corpus` (a Hugging Face model pair),
    `.corpus.difference` holds each head's difference per statistic (B − A) with its 95%
    interval over examples. `to_json()` is the `--json` document, `rows()` the CSV's."""
    from attnviz.app.compare import CompareRequest, run_compare
    from attnviz.core.choices import LongExamples

    model_a = _path(model, "model")
    return run_compare(CompareRequest(
        str(_path(against, "against")), None if model_a is None else str(model_a),
        _path(weights, "weights"),
        _path(corpus, "corpus"), _hints(num_heads, num_kv_heads, head_dim),
        _str(field, "field"), _str(device, "device", allow_none=False) or "auto",
        Dtype.parse(dtype, "dtype"), Weighting.parse(weighting, "weighting"),
        _int(max_tokens, "max_tokens", 1) or 1, LongExamples.parse(long, "long"), None,
        _int(limit, "limit", 1, True), _int(sample, "sample", 1, True),
        _int(seed, "seed", 0, high=MAX_SEED) or 0))
