"""One heatmap run through the model's own forward pass: the shown layers' maps captured
(whole, or reduced block by block for long inputs), realigned to real tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.forward_pass.inputs import find_query
from attnviz.compute.forward_pass.results import (
    AttentionRun,
    CapturedScores,
    LayerAttention,
    ModelCall,
    heads_seen,
)
from attnviz.core import memory
from attnviz.core.choices import LayerKind
from attnviz.errors import (
    CheckpointError,
    UsageError,
    option,
    printable,
    printable_path,
)
from attnviz.sources.hf import capture, guard
from attnviz.sources.hf.collect import Collector, ExportRows, input_hooks
from attnviz.sources.hf.inputs import Prepared
from attnviz.sources.hf.layers import (
    ModelLayer,
    ModelRun,
    Plan,
    cols_tokens,
    model_layers,
    offsets,
    rows_tokens,
)
from attnviz.sources.hf.load import PATHS, TOLERANCE, LoadedModel, input_device
from attnviz.sources.hf.value_states import attach_value_norms, check_values


@dataclass
class _Setup:
    """What a run decided before the model ran."""

    indices: list[int] | None  # the calls shown (None: every call)
    keep_qk: bool | list[int]  # whose query and key the capture keeps (for --query)
    reducers: dict[int, Any]  # layer index: its MapReducer, when the maps stream
    query_row: tuple[int, int] | None  # (sentence, row) of --query, when known
    planned: memory.MemoryPlan  # streamed or whole, and the eager blocks' size


def run_plan(loaded: LoadedModel, plan: Plan, how: ModelRun | None = None,
              export_rows: ExportRows | None = None) -> AttentionRun:
    """The model's own attention weights (and attention inputs) of the layers the plan shows,
    run as `how` says (None: as planned, `plan.how`).

    With how.allow_stream, when the memory plan streams the source layers shown (`memory_plan`:
    their full maps exceed the budget, or have more than 512 keys and the run does not read
    them whole, as how.values does), each is reduced block by block to display views and statistics
    (`attnviz.compute.forward_pass.streaming.MapReducer`) and dropped, keeping only the last
    layer's inputs
    and, for query = (sentence, token spec), that query's row of every head of the last layer.
    Decoder and cross-attention maps (rows are target tokens) are always kept whole.
    With query, the last layer's query, key and mask are kept for the breakdown.
    export_rows, when given, receives every shown layer's blocks as they arrive, realigned
    (for --export of long inputs), and the inputs of every shown layer are kept.
    how.memory_budget: bytes the full maps may take before they stream (default 256 MB); the
    eager blocks of query rows then take at most a quarter of it (and never more than 32 MB).
    """
    how = how or plan.how
    query, values = how.query, how.values
    if query is not None and loaded.path != capture.CapturePath.INTERFACE:
        raise UsageError(f"{option('query')} needs the q and k the model's attention receives, "
                         "which only models using transformers' attention interface hand out; "
                         f"{type(loaded.model).__name__} returns its maps through "
                         "output_attentions", fix=f"drop {option('query')}", option="query")
    setup = _setup(plan, how)
    if values:
        check_values(loaded)
        setup.keep_qk = True
    collector = Collector(plan, setup.reducers, export_rows)
    result, inputs = _capture(loaded, plan, setup, collector, every_input=export_rows is not None)
    shown = plan.shown
    if shown is None:
        shown = _number_after_run(loaded, plan, result.layers, setup.indices)
        collector.replay(shown)
        if query is not None:
            setup.query_row = query[0], find_query(rows_tokens(plan, shown[-1])[query[0]],
                                                   query[1])
    calls = {call.index: call for call in result.layers}
    ran = _Ran(loaded, plan, collector, setup, inputs)
    results = [_layer_result(ran, layer, calls[layer.index],
                             query is not None and layer is shown[-1]) for layer in shown]
    if values:
        attach_value_norms(loaded, plan, result.layers, shown, results)
    causal = all(r.causal for r in results if r.kind != LayerKind.CROSS)
    return AttentionRun(plan.prepared.batch, tuple(results), str(loaded.folder),  # exact: data
                        DESCRIBED_INPUTS, str(input_device(loaded.model)), causal, None,
                        _notes(loaded, plan, bool(setup.reducers)), TOLERANCE[loaded.dtype],
                        target=plan.prepared.target, path=PATHS[result.path])


def memory_plan(plan: Plan, memory_budget: int | None = None,
                keep: bool = False) -> memory.MemoryPlan:
    """The memory plan of a run (`attnviz.core.memory.model_plan`): the full maps of the source
    layers a probed plan shows stream when together they exceed the budget, or have more than
    WHOLE_KEYS keys and are not kept (then each is reduced block by block, and --export written
    as it goes). Not probed: the input is short, nothing streams."""
    shown = plan.shown or []
    source_layers = [layer for layer in shown if layer.kind == LayerKind.SELF]
    heads = max((layer.num_heads or 0 for layer in source_layers), default=0)
    return memory.model_plan(len(plan.prepared.batch.tokens), plan.prepared.batch.max_len,
                             heads, len(source_layers), memory_budget, keep)


DESCRIBED_INPUTS = ("the model's own hidden states entering each attention module (token and "
                    "position embeddings, earlier layers and the block's own norm, if any)")


def _setup(plan: Plan, how: ModelRun) -> _Setup:
    """Which calls to show, whether they stream, and the --query row when the layers are known
    (resolved before the model runs: a typo costs nothing)."""
    from attnviz.compute.forward_pass import streaming

    shown, batch, query = plan.shown, plan.prepared.batch, how.query
    planned = memory_plan(plan, how.memory_budget, keep=how.values)
    if shown is None:  # short input, layers numbered by the run itself
        if query is not None:
            find_query(batch.tokens[query[0]], query[1])
        indices = plan.indices
        return _Setup(indices, query is not None and (indices is None or [max(indices)]), {},
                      None, planned)
    last = shown[-1]
    query_row = None if query is None else (
        query[0], find_query(rows_tokens(plan, last)[query[0]], query[1]))
    source_layers = [layer for layer in shown if layer.kind == LayerKind.SELF]
    stream = how.allow_stream and planned.streamed
    reducers = {layer.index: streaming.MapReducer(
        layer.index, batch.tokens, query_row if layer is last else None, views=how.views)
        for layer in source_layers} if stream else {}
    return _Setup([layer.index for layer in shown], [last.index] if query is not None else False,
                  reducers, query_row, planned)


def _capture(loaded: LoadedModel, plan: Plan, setup: _Setup, collector: Collector,
             every_input: bool = False
             ) -> tuple[capture.CaptureResult, dict[tuple[str, int], torch.Tensor]]:
    """The forward pass, with the attention modules' inputs kept (only the last layer's when
    the maps stream, unless every_input)."""
    keep = None if every_input or not setup.reducers or plan.shown is None \
        else {plan.shown[-1].index}
    handles, inputs = input_hooks(plan, keep)
    try:
        with guard.silenced():
            result = capture.capture(plan.prepared.runner, plan.prepared.feed, setup.indices,
                                 setup.planned.block_bytes, collector, keep_qk=setup.keep_qk)
    except UsageError as error:
        if not error.what.startswith("no attention layer"):
            raise
        count = error.what.split("ran ")[-1].split(" ")[0]
        fix = f"use all, 0..{int(count) - 1}, -1 or A:B"
        if loaded.encoder_decoder:
            fix = "a bare number is an encoder layer; name the decoder's: 'dec N', 'cross N'"
        raise UsageError(f"{option('layer')} {plan.spec!r} is not a layer of this model", fix=fix,
                         option="layer") from None
    except (RuntimeError, ValueError, IndexError) as exc:  # the model itself failed on the input
        raise CheckpointError(f"the model's forward pass failed: {printable(str(exc), 200)}",
                              fix="check that the model runs in transformers on this input",
                              where=printable_path(loaded.folder)) from None
    finally:
        for handle in handles:
            handle.remove()
    return result, inputs


def _number_after_run(loaded: LoadedModel, plan: Plan, calls: list[capture.CapturedLayer],
                      indices: list[int] | None) -> list[ModelLayer]:
    """The shown layers of a run made without a probe, numbered from its own calls."""
    layers = model_layers(loaded, plan.prepared, calls)
    if not layers:
        raise CheckpointError("the model's forward pass made no attention call",
                              fix="report this model to attnviz",
                              where=printable_path(loaded.folder))
    shown = layers if indices is None else [layers[i] for i in indices]
    if any(layer.stack not in ("", "enc") for layer in shown) and plan.spec not in (None, "all"):
        encoder = sum(layer.stack == "enc" for layer in layers)
        raise UsageError(f"{option('layer')} {plan.spec!r}: a bare number is an encoder layer, "
                         f"and the encoder has {encoder}", fix=f"use 0..{encoder - 1}, or name the "
                         "stack: 'dec N', 'cross N'", option="layer")
    return shown


@dataclass
class _Ran:
    """What the capture left, read by every shown layer's result."""

    loaded: LoadedModel
    plan: Plan
    collector: Collector
    setup: _Setup
    inputs: dict[tuple[str, int], torch.Tensor]  # (module name, occurrence): its input


def _layer_result(ran: _Ran, layer: ModelLayer, call: capture.CapturedLayer,
                  with_scores: bool) -> LayerAttention:
    """One shown layer's LayerAttention: its full maps, or its streamed reduction."""
    from dataclasses import replace

    from attnviz.compute.forward_pass import streaming

    loaded, plan, collector, setup, inputs = (ran.loaded, ran.plan, ran.collector, ran.setup,
                                              ran.inputs)

    method = _method(loaded, plan.prepared, call)
    x = inputs.get((layer.name, layer.occurrence))
    if x is not None:
        x = realign_rows(x, offsets(plan, layer)[0], [len(t) for t in rows_tokens(plan, layer)])
    model_call = ModelCall(
        None if layer.kind == LayerKind.SELF else rows_tokens(plan, layer),
        None if layer.kind != LayerKind.DECODER_SELF else cols_tokens(plan, layer),
        _scores(call, plan, layer) if with_scores else None)
    weights, kept = collector.maps.get(layer.index), None
    if layer.index in setup.reducers:
        kept = setup.reducers[layer.index].finish()
        method = f"{method}, streamed ({streaming.STREAMED})"
        if layer.stack:
            kept = replace(kept, views=[_labelled(v, layer.label) for v in kept.views],
                           stats=[_labelled_stats(s, layer.label) for s in kept.stats])
    # causal as observed on the maps; a layer whose maps were never seen counts as not causal
    return LayerAttention(layer.index, layer.full_name,
                          layer.label if layer.stack else str(layer.index),
                          heads_seen(call.num_heads, weights), layer.kind, method,
                          collector.causal.get(layer.index, False), weights, kept, inputs=x,
                          call=model_call)


def _notes(loaded: LoadedModel, plan: Plan, streamed: bool) -> tuple[str, ...]:
    from attnviz.compute.forward_pass import streaming

    notes = []
    if streamed:
        notes.append("long input: each source layer's maps reduced to display size block by "
                     f"block, {streaming.STREAMED} (≤ {streaming.DISPLAY_CELLS} per side); "
                     f"{option('export')} writes the full maps to its file block by block")
    if loaded.max_memory is not None:
        offloaded = loaded.offloaded
        what = "the whole model" if offloaded == [""] else \
            f"{len(offloaded)} module{'s' * (len(offloaded) != 1)}"
        notes.append(f"weights beyond {option('max_memory')} {_size(loaded.max_memory)}: "
                     + (f"{what} offloaded to disk, each part loaded as the forward reached it"
                        if offloaded else "none (the model fits)"))
    if loaded.encoder_decoder and plan.prepared.target is None:
        notes.append(f"encoder-decoder model: its encoder ran alone ({option('target')} 'text', "
                     "one per sentence, runs the decoder too: 'dec N' and 'cross N' layers)")
    return tuple(notes)


def _size(size: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} bytes"


def _method(loaded: LoadedModel, prepared: Prepared, call: capture.CapturedLayer) -> str:
    if call.computed_with == "output_attentions":
        return "output_attentions (eager)"
    module = dict(prepared.runner.named_modules()).get(call.name)
    owner = type(module).__name__ if module is not None else "its module"
    function = capture.eager_function(module) if module is not None else None
    where = "attnviz's generic eager" if function is capture.generic_eager else \
        f"{owner}'s own eager_attention_forward"
    upcast = f", in float32 from {call.upcast_from} q/k/v (fast on CPU)" if call.upcast_from else ""
    return f"{where}, in blocks of query rows{upcast}"


def _labelled(view: Any, label: str) -> Any:
    from dataclasses import replace

    return replace(view, label=label)


def _labelled_stats(stats: Any, label: str) -> Any:
    from dataclasses import replace

    return replace(stats, layer_label=label)


def _scores(call: capture.CapturedLayer, plan: Plan, layer: ModelLayer) -> CapturedScores | None:
    if call.query is None or call.key is None:
        return None
    kwargs = call.score_kwargs
    scaling = kwargs.get("scaling")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    q_offsets, k_offsets = offsets(plan, layer)
    return CapturedScores(
        call.query, call.key, float(scaling) if scaling is not None else
        call.query.shape[-1] ** -0.5, call.mask, kwargs.get("position_bias"),
        None if kwargs.get("softcap") is None else float(kwargs["softcap"]),
        None if sinks is None else sinks.detach(), tuple(q_offsets), tuple(k_offsets))


def realign_rows(x: torch.Tensor, offsets: list[int], lengths: list[int]) -> torch.Tensor:
    """(B, L, E) with each sentence's real rows moved to 0..n-1, zeros after."""
    out = torch.zeros(x.shape[0], max(lengths), x.shape[2], dtype=x.dtype)
    for b, (offset, n) in enumerate(zip(offsets, lengths, strict=True)):
        out[b, :n] = x[b, offset:offset + n]
    return out

