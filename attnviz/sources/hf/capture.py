"""Attention maps of any Hugging Face model, captured through transformers' attention interface.

Most transformers modeling files (5.x) send every attention call through one function picked from
`ALL_ATTENTION_FUNCTIONS` by `config._attn_implementation`. attnviz registers its own function
there (`NAME`), with the mask builder eager attention uses, so it receives exactly what eager
attention would: per-head `query` (B, H, L, d) after rotary, `key`/`value` (B, H_kv, S, d) before
repeat_kv, the additive mask and the module's kwargs (T5's position_bias, sliding_window, softcap).

For the layers being shown it runs the module's OWN eager function (the one its forward falls back
to), in blocks of query rows when the full (B, H, L, S) maps would exceed a memory budget; softmax
is per row, so blocks are exact. Each block goes to `on_block(layer, row_start, weights)` at once,
so the caller can reduce it without ever holding a full map. Layers not shown go to sdpa.

Layers are numbered in the order the forward pass calls the interface (encoder, then each decoder
layer's self- and cross-attention), which is also the order of `output_attentions`; a module that
runs several times (ALBERT shares one layer) gets one number per call.

Models whose modeling file does not use the interface (BLOOM, Falcon, DeBERTa-v2, MPNet, GPT-Neo)
are run with `output_attentions=True` and eager attention instead; `CaptureResult.path` says which.
transformers is imported lazily, as in the rest of attnviz.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from attnviz.core import memory
from attnviz.core.choices import LayerKind
from attnviz.errors import CheckpointError, UsageError
from attnviz.sources.hf.capture_eager import (
    ACTIVE,
    Session,
    attention_function,
    calls_interface,
    eager_function,
    generic_eager,
)
from attnviz.sources.hf.capture_types import (
    NAME,
    CapturedLayer,
    CapturePath,
    CaptureResult,
    MapCollector,
    OnBlock,
)

__all__ = ["NAME", "CapturePath", "CaptureResult", "CapturedLayer", "MapCollector",
           "OnBlock", "calls_interface", "capture", "eager_function", "generic_eager", "register",
           "uses_interface"]


def register() -> None:
    """Make `NAME` a valid attn_implementation (idempotent).

    transformers 5 accepts any name registered in `AttentionInterface`; but the mask builders
    (`create_causal_mask`, ...) return no mask at all for a name missing from
    `AttentionMaskInterface`, so the eager mask builder is registered under the same name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, attention_function)
    AttentionMaskInterface.register(NAME, eager_mask)


def uses_interface(model: Any) -> bool:
    """Whether `model` sends its attention through `ALL_ATTENTION_FUNCTIONS`: some module does,
    and no attention module computes apart from it (LongT5's encoder runs its own local
    attention beside a decoder that uses the interface: capturing the interface alone would
    silently leave the encoder out, so such a model takes the output_attentions path)."""
    from transformers import PreTrainedModel

    # PreTrainedModel's own methods read the interface too (to validate implementations).
    modules = [m for m in model.modules() if not isinstance(m, PreTrainedModel)]
    calling = {id(m) for m in modules if calls_interface(type(m))}  # type: ignore[arg-type]
    if not calling:
        return False
    return not any(_attention_apart(module, calling) for module in modules)


def _attention_apart(module: Any, calling: set[int]) -> bool:
    """An attention module (by its class name) with no interface call in or below it."""
    if "Attention" not in type(module).__name__:
        return False
    return not any(id(m) in calling for m in module.modules())


def capture(model: Any, inputs: Mapping[str, Any], shown_layers: Iterable[int] | None = None,
            block_budget_bytes: int | None = None, on_block: OnBlock | None = None,
            keep_qk: bool | Iterable[int] = False) -> CaptureResult:
    """Run `model(**inputs)` once and hand each shown layer's maps to `on_block`, block by block.

    shown_layers: call indices (see the module docstring); None shows every layer.
    block_budget_bytes: the most one block of float32 maps (B, H, rows, S) may take; None: one
    block per layer. keep_qk: keep each shown layer's per-head query and key (interface path),
    with its mask and score kwargs; or only those of the call indices it lists.
    """
    try:
        shown = None if shown_layers is None else {operator.index(i) for i in shown_layers}
    except TypeError:
        shown = {-1}  # not integers: the same message as negative ones
    if shown is not None and min(shown, default=0) < 0:
        raise UsageError("shown layers must be call indices 0, 1, ...",
                         fix="resolve negative layer numbers against the model's layer count first")
    if block_budget_bytes is not None and block_budget_bytes <= 0:
        raise UsageError(f"block budget must be positive, not {block_budget_bytes}")
    sink: OnBlock = on_block if on_block is not None else (lambda *_: None)
    names = {id(module): name for name, module in model.named_modules()}
    inputs = dict(inputs)
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs.setdefault("use_cache", False)  # a cache only costs memory here
    if not uses_interface(model):
        result = _capture_output_attentions(model, inputs, shown, block_budget_bytes, sink)
    else:
        register()
        session = Session(model, names, shown, block_budget_bytes, sink, keep_qk)
        previous = model.config._attn_implementation
        if previous != NAME:  # e.g. a model loaded elsewhere with sdpa: switch for this run only
            model.set_attn_implementation(NAME)
        token = ACTIVE.set(session)
        try:
            with torch.no_grad():
                outputs = model(**inputs)
        finally:
            ACTIVE.reset(token)
            if previous != NAME:
                model.set_attn_implementation(previous)
        result = CaptureResult(CapturePath.INTERFACE, session.layers, outputs)
    missing = sorted((shown or set()) - {layer.index for layer in result.layers})
    if missing:
        raise UsageError(f"no attention layer {missing[0]}: the model ran {len(result.layers)} "
                         f"attention layers (0..{len(result.layers) - 1})")
    return result


# --- the output_attentions path ----------------------------------------------------------------

def _capture_output_attentions(model: Any, inputs: dict, shown: set[int] | None,
                               budget: int | None, sink: OnBlock) -> CaptureResult:
    """Models outside the interface return their maps when asked; hand them out the same way."""
    with torch.no_grad():
        outputs = model(**{**inputs, "output_attentions": True})
    maps: list[tuple[LayerKind, torch.Tensor]] = []
    if getattr(outputs, "encoder_attentions", None) is not None:
        maps += [(LayerKind.SELF, m) for m in outputs.encoder_attentions]
        decoder = outputs.decoder_attentions or ()
        cross = outputs.cross_attentions or ()
        for i, self_maps in enumerate(decoder):
            maps.append((LayerKind.DECODER_SELF, self_maps))
            if i < len(cross):
                maps.append((LayerKind.CROSS, cross[i]))
    else:
        maps = [(LayerKind.SELF, m) for m in getattr(outputs, "attentions", None) or ()]
    if not maps or any(m is None for _, m in maps):
        raise CheckpointError(f"{type(model).__name__} returned no attention weights: it makes "
                              "no full attention maps it can report (a state-space model such as "
                              "Mamba has no attention; BigBird's block-sparse attention returns "
                              "none)", fix="attnviz shows full attention maps; for BigBird, "
                              "attention_type='original_full' in config.json makes them")
    _check_full_maps(model, inputs, maps)
    names = _attention_module_names(model, len(maps))
    layers = []
    for index, ((kind, weights), name) in enumerate(zip(maps, names, strict=True)):
        batch, heads, length, keys = weights.shape  # (B, H, L, S)
        show = shown is None or index in shown
        layers.append(CapturedLayer(index, name, kind, show, "output_attentions", heads, None,
                                    length, keys))
        if show:
            rows = memory.eager_rows(budget, batch, heads, length, keys)
            for start in range(0, length, rows):
                sink(index, start, weights[:, :, start:start + rows])
    return CaptureResult(CapturePath.OUTPUT_ATTENTIONS, layers, outputs)


def _check_full_maps(model: Any, inputs: dict, maps: list[tuple[LayerKind, torch.Tensor]]
                     ) -> None:
    """Every returned map must be (B, H, queries, keys) over the inputs' positions: models
    whose attention is not one full map (Longformer and LED return local windows) are refused
    rather than shown wrong."""
    source = inputs["input_ids"].shape[1] if "input_ids" in inputs else None
    target = inputs["decoder_input_ids"].shape[1] if "decoder_input_ids" in inputs else None
    expected = {LayerKind.SELF: (source, source), LayerKind.DECODER_SELF: (target, target),
                LayerKind.CROSS: (target, source)}
    for kind, weights in maps:
        rows, keys = expected[kind]
        if rows is None or keys is None:  # inputs given as embeddings: nothing to compare
            continue
        if weights.ndim != 4 or (rows, keys) != tuple(weights.shape[2:]):
            raise CheckpointError(
                f"{type(model).__name__} returns attention of shape {tuple(weights.shape)}, not "
                f"one full map per head over its {rows} × {keys} positions (windowed or pooled "
                "attention, as Longformer, LED, LongT5 and Funnel compute)",
                fix="attnviz shows full attention maps, which this model does not make")


def _attention_module_names(model: Any, count: int) -> list[str]:
    """Best effort: the innermost modules whose class name says Attention, when there are as
    many as maps (BLOOM's h.0.self_attention, DeBERTa's encoder.layer.0.attention.self)."""
    found = [name for name, module in model.named_modules()
             if "Attention" in type(module).__name__
             and not any("Attention" in type(child).__name__ for child in module.children())]
    return found if len(found) == count else [f"attentions.{i}" for i in range(count)]
