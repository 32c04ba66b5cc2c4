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

import io
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from attnviz.app.circuits import CircuitsRequest, CircuitsResult, run_circuits
from attnviz.app.heatmap import HeatmapJob, HeatmapResult
from attnviz.app.heatmap import run_heatmap as _run_heatmap
from attnviz.app.inspect_checkpoint import InspectRequest, InspectResult, inspect_checkpoint
from attnviz.app.split import SplitRequest, SplitResult, run_split
from attnviz.compute.inputs import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS
from attnviz.load.checkpoint import TensorStore
from attnviz.load.checkpoint import open_checkpoint as _open_checkpoint
from attnviz.recognize import Inventory
from attnviz.recognize import find_layers as _find_layers
from attnviz.recognize.base import HeadHints
from attnviz.sources.layers import DEFAULT_EMBED_DIM, DEFAULT_NUM_HEADS, RandomSpec

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from matplotlib.figure import Figure

_T = TypeVar("_T")


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


class Split(SplitResult):
    """A layer's head split and proof (`report`), with a figure of W_q, W_k, W_v, W_o."""

    def figure(self) -> Figure:
        """A matplotlib Figure of the four matrices with head boundaries."""
        from attnviz.render.figure import split_figure

        return split_figure(self.matrix_panels(), self.title)

    def _repr_png_(self) -> bytes:
        return _png(self.figure())


class Heatmap(HeatmapResult):
    """Attention maps (`views`), head statistics (`head_stats`) and the run they came from."""

    def figure(self, scale: str = "max", size: float | None = None,
               dpi: int | None = None) -> Figure:
        """A matplotlib Figure: a grid of the selected maps, one row per sentence and layer
        (`scale` max|fixed|log, `size` the side of a panel in inches, as the CLI's options)."""
        from attnviz.app.weighting import legend
        from attnviz.render.figure import heatmap_figure

        return heatmap_figure(self.views, self.title(), scale, size, dpi,
                              legend(self.run.weighting))

    def ablation_figure(self) -> Figure:
        """The causal head scorecard (`ablate=`): a layers × heads heatmap per measure."""
        from attnviz.errors import UsageError
        from attnviz.render.ablation_figure import ablation_figure

        if self.ablation is None:
            raise UsageError("no scorecard: this run was made without ‹ablate›",
                             fix="pass ablate='zero' or 'mean'", option="ablate")
        return ablation_figure(self.ablation, self.head_stats, self.title())

    def _repr_png_(self) -> bytes:
        return _png(self.figure())

    def html(self) -> str:
        """The interactive page `--html` writes: one self-contained file, no network."""
        from attnviz.render.html import document_from_run, render_html

        return render_html(document_from_run(self.run, self.head_stats, self.breakdown))

    def _repr_html_(self) -> str:
        """Jupyter: the interactive page inline (an iframe; it needs no internet)."""
        from attnviz.render.html import document_from_run, notebook_html

        return notebook_html(document_from_run(self.run, self.head_stats, self.breakdown))


def _as(cls: type[_T], result: DataclassInstance) -> _T:
    return cls(**{f.name: getattr(result, f.name) for f in fields(result)})


def open_checkpoint(path: str | Path) -> TensorStore:
    """A checkpoint file or folder, headers read, tensors read on demand."""
    return _open_checkpoint(Path(path))


def find_layers(checkpoint: str | Path | TensorStore, *, num_heads: int | None = None,
                num_kv_heads: int | None = None, head_dim: int | None = None) -> Inventory:
    """Every attention layer attnviz recognizes in a checkpoint (headers only)."""
    store = checkpoint if isinstance(checkpoint, TensorStore) else open_checkpoint(checkpoint)
    return _find_layers(store, HeadHints(num_heads, num_kv_heads, head_dim))


def inspect(checkpoint: str | Path, *, layer: str | int | None = None,
            num_heads: int | None = None, num_kv_heads: int | None = None,
            head_dim: int | None = None, scan: bool = False) -> InspectResult:
    """What `attnviz inspect` reports, as a document (`.doc`) and per-head detail (`.detail`)."""
    return inspect_checkpoint(InspectRequest(
        Path(checkpoint), None if layer is None else str(layer),
        HeadHints(num_heads, num_kv_heads, head_dim), scan))


def split(weights: str | Path | None = None, *, model: str | None = None,
          layer: str | int | None = None, embed_dim: int | None = None,
          num_heads: int | None = None, num_kv_heads: int | None = None,
          head_dim: int | None = None, kdim: int | None = None, vdim: int | None = None,
          bias: bool = True, seed: int = 0, verify: bool = False) -> Split:
    """How the heads split one layer, proved against torch's forward (`verify`: against the
    model itself). Without weights or model: a random nn.MultiheadAttention(embed_dim, ...)."""
    random = None
    if weights is None and model is None:
        random = RandomSpec(embed_dim or DEFAULT_EMBED_DIM, num_heads or DEFAULT_NUM_HEADS, kdim,
                            vdim, bias, seed=seed)
        num_heads = None
    result = run_split(SplitRequest(
        None if weights is None else Path(weights), model, None if layer is None else str(layer),
        HeadHints(num_heads, num_kv_heads, head_dim), random, seed, verify))
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
    spec = RandomSpec(embed_dim or DEFAULT_EMBED_DIM, num_heads or DEFAULT_NUM_HEADS,
                      seed=seed) if random else None
    job = HeatmapJob(list(sentences), weights=None if weights is None else Path(weights),
                     random=spec, layer=None if layer is None else str(layer),
                     hints=HeadHints(None if random else num_heads), causal=causal,
                     device=device, head=head, average=average,
                     query=None if query is None else str(query), sentence=sentence,
                     keep_full_maps=keep_full_maps, max_tokens=max_tokens,
                     max_sentences=max_sentences, weighting=weighting, ablate=ablate)
    return _as(Heatmap, _run_heatmap(job))


def run_model(model: str | Path, sentences: Sequence[str], *, layer: str | int | None = None,
              head: int | None = None, average: bool = False, query: str | int | None = None,
              sentence: int = 1, device: str = "auto", dtype: str = "float32",
              keep_full_maps: bool = False, targets: Sequence[str] | None = None,
              max_tokens: int = DEFAULT_MAX_TOKENS, weighting: str = "attention",
              ablate: str | None = None, generate: int | None = None,
              sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
              seed: int = 0) -> Heatmap:
    """A Hugging Face model's own attention (needs the `attnviz[hf]` extra; never downloads);
    `targets` (one per sentence) run an encoder-decoder model's decoder too; `weighting` and
    `ablate` as in `run_heatmap`. `generate=N`: the model (with its language-model head)
    writes up to N tokens after each sentence, greedy unless `sample` (with `temperature`,
    `top_p`, `seed`); the maps then cover prompt + generated tokens, and `.generation` says
    what was written."""
    from attnviz.sources.generate_spec import GenerateSpec

    spec = None if generate is None else GenerateSpec(generate, sample, temperature, top_p, seed)
    if spec is not None:
        spec.check()
    job = HeatmapJob(list(sentences), model=str(model), layer=None if layer is None else str(layer),
                     device=device, dtype=dtype, head=head, average=average,
                     query=None if query is None else str(query), sentence=sentence,
                     keep_full_maps=keep_full_maps,
                     targets=None if targets is None else list(targets), max_tokens=max_tokens,
                     weighting=weighting, ablate=ablate, generate=spec)
    return _as(Heatmap, _run_heatmap(job))


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
    spec = RandomSpec(embed_dim or DEFAULT_EMBED_DIM, num_heads or DEFAULT_NUM_HEADS, kdim, vdim,
                      seed=seed) if random else None
    result = run_circuits(CircuitsRequest(
        None if weights is None else Path(weights), None if model is None else str(model),
        None if layer is None else str(layer),
        HeadHints(None if random else num_heads, num_kv_heads, head_dim), spec, composition,
        device))
    return _as(Circuits, result)
