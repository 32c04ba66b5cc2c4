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

import contextvars
import functools
import inspect
import operator
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from attnviz.errors import CheckpointError, UsageError, printable

NAME = "attnviz"  # must not contain "sdpa", "flash", "flex" or "/": transformers treats those apart
# on_block(layer index, first query row, weights (B, H, rows, S)); called once per block.
OnBlock = Callable[[int, int, torch.Tensor], None]
# kwargs sdpa cannot honour: it refuses softcap and silently ignores sinks.
_SDPA_UNSUPPORTED = ("softcap", "s_aux", "sinks")
# kwargs of the attention call that change its scores; kept with the query and key (keep_qk).
_SCORE_KWARGS = ("scaling", "softcap", "position_bias", "s_aux", "sinks")
# Module-name parts of cross-attention (BART family, T5, BERT as a decoder, ...).
_CROSS_PARTS = {"encoder_attn", "EncDecAttention", "crossattention", "cross_attn",
                "cross_attention"}


class CapturePath(str, Enum):
    """How the maps were obtained."""

    INTERFACE = "attention interface"  # attnviz's function, the module's own eager per block
    OUTPUT_ATTENTIONS = "output_attentions (eager)"  # the model's own returned maps


class LayerKind(str, Enum):
    SELF = "self"  # encoder, encoder-only or decoder-only self-attention
    DECODER_SELF = "decoder-self"  # an encoder-decoder model's (causal) decoder self-attention
    CROSS = "cross"  # decoder queries over encoder keys: maps are (B, H, T, S)


@dataclass
class CapturedLayer:
    """One attention call of the forward pass."""

    index: int  # call order: the index `shown_layers` and `on_block` use
    name: str  # the module's name in model.named_modules(), e.g. "encoder.layer.3.attention.self"
    kind: LayerKind
    shown: bool  # its maps went to on_block
    computed_with: str  # "eager" (the module's own), "sdpa", or "output_attentions"
    num_heads: int | None = None  # query heads H
    num_kv_heads: int | None = None  # key/value heads H_kv (< H with grouped-query attention)
    query_length: int | None = None  # L (T for cross-attention)
    key_length: int | None = None  # S
    query: torch.Tensor | None = None  # (B, H, L, d) after rotary, when keep_qk (interface only)
    key: torch.Tensor | None = None  # (B, H_kv, S, d) before repeat_kv, when keep_qk
    # With keep_qk also what else enters the scores: the additive mask (B|1, 1|H, L, S) eager
    # received, and the call's scaling, softcap, position_bias and sinks kwargs, where given.
    mask: torch.Tensor | None = None
    score_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CaptureResult:
    path: CapturePath
    layers: list[CapturedLayer]  # every attention call, in order
    outputs: Any  # the model's own output object (last_hidden_state, ...)

    @property
    def shown(self) -> list[CapturedLayer]:
        return [layer for layer in self.layers if layer.shown]


@dataclass
class MapCollector:
    """An `on_block` that keeps every block and joins them: for small inputs and for tests."""

    blocks: dict[int, list[tuple[int, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list))

    def __call__(self, layer: int, row_start: int, weights: torch.Tensor) -> None:
        self.blocks[layer].append((row_start, weights))

    def maps(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s full maps (B, H, L, S), rows in order."""
        return torch.cat([w for _, w in sorted(self.blocks[layer], key=lambda b: b[0])], dim=2)


def register() -> None:
    """Make `NAME` a valid attn_implementation (idempotent).

    transformers 5 accepts any name registered in `AttentionInterface`; but the mask builders
    (`create_causal_mask`, ...) return no mask at all for a name missing from
    `AttentionMaskInterface`, so the eager mask builder is registered under the same name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def uses_interface(model: Any) -> bool:
    """Whether some module of `model` sends its attention through `ALL_ATTENTION_FUNCTIONS`."""
    from transformers import PreTrainedModel

    # PreTrainedModel's own methods read the interface too (to validate implementations).
    return any(_calls_interface(type(module))  # type: ignore[arg-type]
               for module in model.modules()
               if not isinstance(module, PreTrainedModel))


def load_for_capture(folder: str | Path, model_class: str = "AutoModel",
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A local model (never downloaded, no repository code), ready for `capture`.

    It is loaded with eager attention, then switched to attnviz's implementation when its modeling
    file uses the interface; otherwise it stays eager for the output_attentions path.
    """
    import transformers

    register()
    loader = getattr(transformers, model_class, None)
    if loader is None or not hasattr(loader, "from_pretrained"):
        raise UsageError(f"transformers has no model class {model_class!r}")
    try:
        model = loader.from_pretrained(folder, attn_implementation="eager", dtype=dtype,
                                       local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"transformers cannot load the model: {printable(str(error), 200)}",
                              fix="pass a folder holding config.json and the weights",
                              where=printable(str(folder))) from None
    model = model.to(device).eval()
    if uses_interface(model):
        model.set_attn_implementation(NAME)
    return model


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
        session = _Session(model, names, shown, block_budget_bytes, sink, keep_qk)
        previous = model.config._attn_implementation
        if previous != NAME:  # e.g. a model loaded elsewhere with sdpa: switch for this run only
            model.set_attn_implementation(NAME)
        token = _ACTIVE.set(session)
        try:
            with torch.no_grad():
                outputs = model(**inputs)
        finally:
            _ACTIVE.reset(token)
            if previous != NAME:
                model.set_attn_implementation(previous)
        result = CaptureResult(CapturePath.INTERFACE, session.layers, outputs)
    missing = sorted((shown or set()) - {layer.index for layer in result.layers})
    if missing:
        raise UsageError(f"no attention layer {missing[0]}: the model ran {len(result.layers)} "
                         f"attention layers (0..{len(result.layers) - 1})")
    return result


# --- the interface path ------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("attnviz_capture",
                                                                          default=None)


class _Session:
    """The state of one `capture` call, reached by the registered function through `_ACTIVE`."""

    def __init__(self, model: Any, names: dict[int, str], shown: set[int] | None,
                 budget: int | None, sink: OnBlock, keep_qk: bool | Iterable[int]) -> None:
        self.names = names
        self.shown = shown
        self.budget = budget
        self.sink = sink
        self.keep_qk = keep_qk if isinstance(keep_qk, bool) else {operator.index(i)
                                                                   for i in keep_qk}
        self.layers: list[CapturedLayer] = []
        # sdpa refuses some models outright (Gemma 2's softcapping): those run eager throughout.
        self.sdpa_ok = bool(getattr(model, "_supports_sdpa", True))
        self.encoder_prefix = _encoder_prefix(model, names)

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, args: tuple, kwargs: dict) -> tuple[torch.Tensor, None]:
        index = len(self.layers)
        name = self.names.get(id(module), type(module).__name__)
        show = self.shown is None or index in self.shown
        fast = self.sdpa_ok and all(kwargs.get(k) is None for k in _SDPA_UNSUPPORTED)
        layer = CapturedLayer(index, name, self._kind(name), show,
                              "eager" if show or not fast else "sdpa", query.shape[1],
                              key.shape[1], query.shape[2], key.shape[2])
        self.layers.append(layer)
        if show:
            if self.keep_qk is True or (not isinstance(self.keep_qk, bool)
                                        and index in self.keep_qk):
                layer.query, layer.key = query.detach(), key.detach()
                layer.mask = None if mask is None else mask.detach()
                layer.score_kwargs = {k: kwargs[k] for k in _SCORE_KWARGS
                                      if kwargs.get(k) is not None}
            return self._blocks(index, module, query, key, value, mask, args, kwargs), None
        if fast:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, *args,
                                                   **kwargs)
        output, _ = eager_function(module)(module, query, key, value, mask, *args, **kwargs)
        return output, None

    def _kind(self, name: str) -> LayerKind:
        if self.encoder_prefix is None:
            return LayerKind.SELF
        if name.startswith(self.encoder_prefix):
            return LayerKind.SELF
        if _CROSS_PARTS & set(name.split(".")):
            return LayerKind.CROSS
        return LayerKind.DECODER_SELF

    def _blocks(self, index: int, module: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, mask: torch.Tensor | None, args: tuple,
                kwargs: dict) -> torch.Tensor:
        """The module's own eager attention, `rows` query rows at a time; key/value stay whole."""
        eager = eager_function(module)
        batch, heads, length, _ = query.shape  # (B, H, L, d)
        rows = _rows_per_block(self.budget, batch, heads, length, key.shape[2])
        outputs = []
        for start in range(0, length, rows):
            stop = min(length, start + rows)
            block_kwargs = {k: _query_rows(v, start, stop, length) for k, v in kwargs.items()}
            output, weights = eager(module, query[:, :, start:stop],  # (B, H, rows, d)
                                    key, value, _query_rows(mask, start, stop, length), *args,
                                    **block_kwargs)
            if weights is None:
                raise CheckpointError(f"the eager attention of {type(module).__name__} returned "
                                      "no weights", fix="report this model to attnviz")
            if rows < length and output.shape[1] != stop - start:  # not (B, rows, H, d)
                raise CheckpointError(f"the eager attention of {type(module).__name__} returns "
                                      "an output attnviz cannot join by query rows",
                                      fix="capture it without a block budget")
            self.sink(index, start, weights)  # (B, H, rows, S)
            outputs.append(output)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (B, L, H, d)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The function registered under `NAME`; outside `capture` it is plain sdpa (or eager)."""
    session = _ACTIVE.get()
    if session is not None:
        return session.attend(module, query, key, value, attention_mask, args, kwargs)
    if any(kwargs.get(k) is not None for k in _SDPA_UNSUPPORTED):
        return eager_function(module)(module, query, key, value, attention_mask, *args, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, *args,
                                           **kwargs)


def eager_function(module: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The eager attention `module`'s forward falls back to: `eager_attention_forward` where its
    forward is defined (a subclass may inherit forward from another family), else its own file's,
    else attnviz's generic one. Looked up per call, so a patched function is seen."""
    forward = inspect.unwrap(type(module).forward)
    found = getattr(forward, "__globals__", {}).get("eager_attention_forward")
    if found is None:
        found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return found if found is not None else generic_eager


def generic_eager(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, position_bias: torch.Tensor | None = None,
                  softcap: float | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scaling [+ bias] [+ mask])·v with grouped key/value heads repeated."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # (B, H, S, d)
    value = value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, L, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights  # (B, L, H, d)


@functools.cache
def _calls_interface(cls: type) -> bool:
    """A class whose own methods (or a base's, below nn.Module) read ALL_ATTENTION_FUNCTIONS."""
    for base in cls.__mro__:
        if base is torch.nn.Module or base.__module__.startswith("torch."):
            continue
        for value in vars(base).values():
            code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
            if code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names:
                return True
    return False


def _encoder_prefix(model: Any, names: dict[int, str]) -> str | None:
    """The encoder's module-name prefix of an encoder-decoder model ("encoder."), else None."""
    if not getattr(model.config, "is_encoder_decoder", False):
        return None
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    name = names.get(id(encoder)) if encoder is not None else None
    return None if not name else name + "."


def _rows_per_block(budget: int | None, batch: int, heads: int, length: int, keys: int) -> int:
    if budget is None:
        return length
    per_row = batch * heads * keys * 4  # float32: eager's softmax runs in float32 at least
    return max(1, min(length, budget // per_row))


def _query_rows(value: Any, start: int, stop: int, length: int) -> Any:
    """Rows start:stop of a per-query 4-D tensor (B|1, H|1, L, S): masks, position biases.
    Anything else (scalars, sinks, position ids, broadcast rows) passes unchanged."""
    if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[2] == length:
        return value[:, :, start:stop]
    return value


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
        raise CheckpointError("the model returned no attention weights",
                              fix="load it with attn_implementation='eager'")
    names = _attention_module_names(model, len(maps))
    layers = []
    for index, ((kind, weights), name) in enumerate(zip(maps, names, strict=True)):
        batch, heads, length, keys = weights.shape  # (B, H, L, S)
        show = shown is None or index in shown
        layers.append(CapturedLayer(index, name, kind, show, "output_attentions", heads, None,
                                    length, keys))
        if show:
            rows = _rows_per_block(budget, batch, heads, length, keys)
            for start in range(0, length, rows):
                sink(index, start, weights[:, :, start:start + rows])
    return CaptureResult(CapturePath.OUTPUT_ATTENTIONS, layers, outputs)


def _attention_module_names(model: Any, count: int) -> list[str]:
    """Best effort: the innermost modules whose class name says Attention, when there are as
    many as maps (BLOOM's h.0.self_attention, DeBERTa's encoder.layer.0.attention.self)."""
    found = [name for name, module in model.named_modules()
             if "Attention" in type(module).__name__
             and not any("Attention" in type(child).__name__ for child in module.children())]
    return found if len(found) == count else [f"attentions.{i}" for i in range(count)]
