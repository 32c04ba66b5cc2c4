"""Three heatmap sources that run attnviz's own kernel on a padded batch of sentences: the
bundled model (`BundledModel`), one layer of a checkpoint on synthetic inputs (`CheckpointLayer`;
an attnviz-tiny checkpoint runs whole, as the bundled model does) and a random
nn.MultiheadAttention (`RandomLayer`). Each checks a request from headers alone (--max-tokens,
--max-sentences, the source's own positions, the layer, its heads) before any tensor is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from attnviz.app.export import StreamedExport
from attnviz.app.heatmap_sources import (
    Checked,
    Ran,
    check_sentence,
    request_sentences,
    source_limit,
)
from attnviz.app.standalone import head_hint_warnings, renumber, synthetic_note
from attnviz.compute.forward_pass.inputs import Batch
from attnviz.core.request import HeatmapRequest
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    import torch

    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.core.layer import AttentionLayer
    from attnviz.load.store import TensorStore
    from attnviz.sources.registry import OpenedSource


@dataclass
class LayerPlan:
    """What a checked request runs: the batch, and the layer or layers chosen."""

    batch: Batch
    device: torch.device
    query_row: tuple[int, int] | None  # (sentence, token) of --query: kept when streaming
    store: TensorStore | None = None  # the checkpoint (None: a random layer)
    tiny: list[int] | None = None  # an attnviz-tiny model: the layers shown (None: all)
    layer: AttentionLayer | None = None  # a checkpoint's layer
    index: int = 0  # … its index in the checkpoint


class _OnBatch:
    """check(): the batch within every limit, then `plan` (the source's own checks)."""

    def open(self, request: HeatmapRequest) -> OpenedSource | None:
        """The source, opened through the one registry (its layers as `inspect` lists them)."""
        from attnviz.sources.registry import open_source

        return open_source(request.source)

    def check(self, request: HeatmapRequest) -> Checked[LayerPlan]:
        opened = self.open(request)
        limit = None if opened is None else source_limit(opened.store, request.source.weights)
        from attnviz.compute.forward_pass.inputs import make_batch

        batch = make_batch(request_sentences(request, limit), request.limits.max_tokens,
                           request.limits.max_sentences, limit)
        check_sentence(request, len(batch.tokens))
        return self.plan(request, batch, opened)

    def plan(self, request: HeatmapRequest, batch: Batch, opened: OpenedSource | None
             ) -> Checked[LayerPlan]:
        raise NotImplementedError

    def run(self, request: HeatmapRequest, checked: Checked[LayerPlan],
            report: Callable[[str], None]) -> Ran:
        batch = checked.state.batch
        report(f"running attention on {_count(len(batch.tokens), 'sentence')} "
               f"({_count(sum(batch.lengths), 'token')})")
        attention_run = self.compute(request, checked.state)
        ablation = None
        if request.measure.ablate is not None:
            from attnviz.app.ablate import ablate_standalone

            ablation = ablate_standalone(attention_run, request.measure.ablate,
                                         request.selection.head, report,
                                         request.limits.memory_budget)
        return Ran(attention_run, ablation)

    def compute(self, request: HeatmapRequest, plan: LayerPlan) -> AttentionRun:
        raise NotImplementedError


def _common(request: HeatmapRequest, batch: Batch) -> tuple[torch.device, tuple[int, int] | None]:
    """The --query row (resolved before any work: a typo costs nothing) and the device,
    checked (the positions scheme is a Positions member, parsed where the request is built)."""
    from attnviz.compute.forward_pass.device import resolve_device
    from attnviz.compute.forward_pass.inputs import find_query

    query_row = None
    if request.selection.query is not None:
        index = request.selection.sentence - 1
        query_row = index, find_query(batch.tokens[index], request.selection.query)
    return resolve_device(request.source.device), query_row


class RandomLayer(_OnBatch):
    """A random nn.MultiheadAttention of the request's `source.random` spec."""

    def open(self, request: HeatmapRequest) -> OpenedSource | None:
        return None  # the layer is built in `compute`, after every check

    def plan(self, request: HeatmapRequest, batch: Batch, opened: OpenedSource | None
             ) -> Checked[LayerPlan]:
        from attnviz.sources.random_layer import check_random_spec

        spec = request.source.random
        assert spec is not None  # the table picks this source for a random spec only
        device, query_row = _common(request, batch)
        check_random_spec(spec)
        return Checked(len(batch.tokens), (1, spec.num_heads), LayerPlan(batch, device,
                                                                         query_row))

    def compute(self, request: HeatmapRequest, plan: LayerPlan) -> AttentionRun:
        from attnviz.sources.registry import open_source

        opened = open_source(request.source)
        return run_standalone(request, plan, opened.layers[0], opened.store,
                              request.source.causal)


class CheckpointLayer(_OnBatch):
    """One attention layer of a checkpoint (`source.weights`, `selection.layer`) on synthetic
    inputs; an attnviz-tiny checkpoint runs whole, as the bundled model."""

    def plan(self, request: HeatmapRequest, batch: Batch, opened: OpenedSource | None
             ) -> Checked[LayerPlan]:
        from attnviz.sources.bundled import is_tiny_model

        assert opened is not None
        store = opened.store
        device, query_row = _common(request, batch)
        if is_tiny_model(store):
            return _tiny_plan(request, batch, store, device, query_row)
        hints = request.source.hints
        inventory = opened.inventory  # the registry's: discovery included, as inspect lists
        layer = opened.select(request.selection.layer)
        if not layer.heads_known:
            raise UsageError(f"the number of heads of layer {layer.name!r} is unknown",
                             fix=f"pass {option('num_heads')} (and {option('num_kv_heads')} "
                             "for grouped-query layers)", option="num_heads")
        warnings = [] if hints.num_heads is None else \
            head_hint_warnings(store, hints, request.selection.layer, layer)
        return Checked(len(batch.tokens), (1, layer.num_heads or 0), LayerPlan(
            batch, device, query_row, store, None, layer, inventory.layers.index(layer)),
            warnings)

    def compute(self, request: HeatmapRequest, plan: LayerPlan) -> AttentionRun:
        if plan.layer is None:
            return _run_tiny(plan)
        assert plan.store is not None
        attention_run = run_standalone(request, plan, plan.layer, plan.store,
                                       request.source.causal or plan.layer.causal)
        attention_run = renumber(attention_run, plan.index)
        note = synthetic_note(plan.store, request.source.weights, plan.index)
        return replace(attention_run, notes=(note, *attention_run.notes))


class BundledModel(CheckpointLayer):
    """The bundled 2-layer model (attnviz/data), run whole (the registry opens it)."""


def _tiny_plan(request: HeatmapRequest, batch: Batch, store: TensorStore,
               device: torch.device, query_row: tuple[int, int] | None) -> Checked[LayerPlan]:
    from attnviz.core.selection import parse_layers
    from attnviz.sources.bundled import tiny_layers

    if request.source.positions != "none":
        raise UsageError("the bundled model has its own learned positions",
                         fix=f"drop {option('positions')}", option="positions")
    layers = tiny_layers(store)  # checked against the metadata's counts
    chosen = parse_layers(request.selection.layer, len(layers))
    panels = (len(layers) if chosen is None else len(chosen),
              max(layer.num_heads or 0 for layer in layers))
    return Checked(len(batch.tokens), panels,
                   LayerPlan(batch, device, query_row, store, chosen))


def _run_tiny(plan: LayerPlan) -> AttentionRun:
    from attnviz.sources.bundled import run_tiny

    assert plan.store is not None
    return run_tiny(plan.store, plan.batch, plan.tiny, plan.device)


def run_standalone(request: HeatmapRequest, plan: LayerPlan, layer: AttentionLayer,
                   store: TensorStore, causal: bool) -> AttentionRun:
    """run_layer on the plan's batch (the plan's checkpoint, if any, makes the inputs), with
    --export of long inputs written block by block as the maps stream (the file is complete,
    and moved into place, only when the run succeeds)."""
    from attnviz.app.outputs import atomic_output
    from attnviz.compute.forward_pass.attention import run_layer
    from attnviz.compute.forward_pass.layer_stream import LayerRun, plan_for

    batch, export = plan.batch, request.outputs.export
    run = LayerRun(plan.device, causal, request.source.positions, request.limits.memory_budget,
                   not request.outputs.full_maps, request.measure.weighting == "norm",
                   plan.query_row, request.outputs.views)
    too_large = plan_for(layer, batch, replace(run, keep=True)).streamed  # even when kept whole
    if export is None or not too_large:
        return run_layer(layer, store, batch, run, plan.store)
    with atomic_output(export) as tmp, open(tmp, "wb") as file:
        sink = StreamedExport(file, batch, layer, store.source, causal, plan.index)
        result = run_layer(layer, store, batch, replace(run, allow_stream=True, keep=False),
                           plan.store, sink)
        sink.close()
    return replace(result, exported=export)


def run_on_batch(batch: Batch, request: HeatmapRequest) -> AttentionRun:
    """A standalone request on a batch made already (tests, benchmarks): checked, then run."""
    from attnviz.sources.registry import SourceKind, source_kind

    kind = source_kind(request.source)
    if kind is SourceKind.MODEL:
        raise UsageError(f"a batch runs on a standalone layer, not {option('model')}",
                         fix=f"drop {option('model')}")
    source = {SourceKind.RANDOM: RandomLayer, SourceKind.BUNDLED: BundledModel,
              SourceKind.WEIGHTS: CheckpointLayer}[kind]()
    return source.compute(request, source.plan(request, batch, source.open(request)).state)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
