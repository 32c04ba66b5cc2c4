"""The interface path of a capture: attnviz's registered attention function, the session it
reaches through a context variable, and the module's own eager attention run in blocks of query
rows for the layers shown."""

from __future__ import annotations

import contextvars
import functools
import inspect
import operator
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from attnviz.core import memory
from attnviz.core.choices import LayerKind
from attnviz.errors import CheckpointError
from attnviz.sources.hf.capture_types import (
    CROSS_PARTS,
    SCORE_KWARGS,
    SDPA_UNSUPPORTED,
    CapturedLayer,
    OnBlock,
)

# --- the interface path ------------------------------------------------------------------------

ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("attnviz_capture",
                                                                          default=None)


class Session:
    """The state of one `capture` call, reached by the registered function through `ACTIVE`."""

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
        # a model passes one mask object to every layer: its float32 copy and the keys each
        # block of it sees are worked out once, per use (slot), for the latest mask of each
        # use only, which stays alive: (mask, its version, {key: value})
        self._per_mask: dict[str, tuple[torch.Tensor, int, dict[Any, Any]]] = {}

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, args: tuple, kwargs: dict) -> tuple[torch.Tensor, None]:
        index = len(self.layers)
        name = self.names.get(id(module), type(module).__name__)
        show = self.shown is None or index in self.shown
        fast = self.sdpa_ok and all(kwargs.get(k) is None for k in SDPA_UNSUPPORTED)
        layer = CapturedLayer(index, name, self._kind(name), show,
                              "eager" if show or not fast else "sdpa", query.shape[1],
                              key.shape[1], query.shape[2], key.shape[2])
        self.layers.append(layer)
        if show:
            if self.keep_qk is True or (not isinstance(self.keep_qk, bool)
                                        and index in self.keep_qk):
                layer.query, layer.key = query.detach(), key.detach()
                layer.value = value.detach()
                layer.mask = None if mask is None else mask.detach()
                layer.score_kwargs = {k: kwargs[k] for k in SCORE_KWARGS
                                      if kwargs.get(k) is not None}
            if _upcast(query):
                layer.upcast_from = str(query.dtype).removeprefix("torch.")
                output = self._blocks(index, module, (query.float(), key.float(), value.float()),
                                      self._float_mask(mask), args,
                                      {k: _float(v) for k, v in kwargs.items()})
                return output.to(query.dtype), None
            return self._blocks(index, module, (query, key, value), mask, args, kwargs), None
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
        if CROSS_PARTS & set(name.split(".")):
            return LayerKind.CROSS
        return LayerKind.DECODER_SELF

    def _blocks(self, index: int, module: Any,
                qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                args: tuple, kwargs: dict) -> torch.Tensor:
        """The module's own eager attention, `rows` query rows at a time; key/value stay whole."""
        query, key, value = qkv
        eager = eager_function(module)
        batch, heads, length, _ = query.shape  # (B, H, L, d)
        total = key.shape[2]
        rows = memory.eager_rows(self.budget, batch, heads, length, total)
        narrow = getattr(self.sink, "narrow_blocks", False)
        outputs = []
        for start in range(0, length, rows):
            stop = min(length, start + rows)
            block_mask = _query_rows(mask, start, stop, length)
            block_kwargs = {k: _query_rows(v, start, stop, length) for k, v in kwargs.items()}
            seen = self._keys_seen(mask, (start, stop, length), total,
                                   (*args, *block_kwargs.values())) if narrow else total
            block_key, block_value = key, value
            if seen < total:  # a causal block: only the keys its queries see
                block_key, block_value = key[:, :, :seen], value[:, :, :seen]
                block_mask = _key_columns(block_mask, total, seen)
                block_kwargs = {k: _key_columns(v, total, seen) for k, v in block_kwargs.items()}
            output, weights = eager(module, query[:, :, start:stop],  # (B, H, rows, d)
                                    block_key, block_value, block_mask, *args, **block_kwargs)
            if weights is None:
                raise CheckpointError(f"the eager attention of {type(module).__name__} returned "
                                      "no weights", fix="report this model to attnviz")
            if rows < length and output.shape[1] != stop - start:  # not (B, rows, H, d)
                raise CheckpointError(f"the eager attention of {type(module).__name__} returns "
                                      "an output attnviz cannot join by query rows",
                                      fix="capture it without a block budget")
            self.sink(index, start, weights)  # (B, H, rows, S), or (…, seen) for a narrow sink
            outputs.append(output)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (B, L, H, d)

    def _once_per_mask(self, slot: str, mask: Any, key: Any, compute: Callable[[], Any]) -> Any:
        """compute(), worked out once per mask object (and version) and key in `slot`; every
        time for what has no version counter (not a tensor, or an inference tensor)."""
        version = _version(mask)
        if version is None:
            return compute()
        held = self._per_mask.get(slot)
        if held is None or held[0] is not mask or held[1] != version:
            held = self._per_mask[slot] = (mask, version, {})
        if key not in held[2]:
            held[2][key] = compute()
        return held[2][key]

    def _float_mask(self, mask: Any) -> Any:
        return self._once_per_mask("float", mask, None, lambda: _float(mask))

    def _keys_seen(self, mask: Any, rows: tuple[int, int, int], total: int,
                   extras: Iterable[Any]) -> int:
        """keys_seen of the mask's query rows start:stop (of `length`); the mask's part once
        per mask and block (the other arguments are checked on every call)."""
        start, stop, length = rows
        if not plain_key_extras(extras, total):
            return total
        return int(self._once_per_mask(
            "seen", mask, (*rows, total),
            lambda: keys_seen(_query_rows(mask, start, stop, length), total, ())))


def attention_function(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The function registered under `NAME`; outside `capture` it is plain sdpa (or eager)."""
    session = ACTIVE.get()
    if session is not None:
        return session.attend(module, query, key, value, attention_mask, args, kwargs)
    if any(kwargs.get(k) is not None for k in SDPA_UNSUPPORTED):
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
def calls_interface(cls: type) -> bool:
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


def _upcast(query: torch.Tensor) -> bool:
    """Half precision on a CPU: its matmuls have no fast kernel there, so the shown layers'
    eager attention runs on float32 copies (the maps are then at least as exact; the output
    goes back to the model in its own dtype)."""
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def _float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def keys_seen(mask: Any, total: int, extras: Iterable[Any]) -> int:
    """How many leading keys a block of queries sees: past the last key any of them sees, every
    key is masked out of every row (its weight is exactly 0), so the module's own eager
    attention over the leading keys alone gives the same weights and output, with less work (a
    causal block skips the keys after its last query). `total` (every key) wherever that cannot
    be shown: no 4-D floating mask over the keys, a row that sees no key (its softmax spreads
    over every key), or another argument of three or more axes over the keys that is not a
    per-query 4-D tensor (an ALiBi bias of shape (B·H, 1, S))."""
    if not (isinstance(mask, torch.Tensor) and mask.ndim == 4 and mask.shape[-1] == total
            and mask.is_floating_point() and plain_key_extras(extras, total)):
        return total
    # transformers masks a key with the dtype's most negative value: exp() of it is 0
    visible = mask > torch.finfo(mask.dtype).min / 2  # (B|1, H|1, rows, S)
    if not bool(visible.any(-1).all()):
        return total
    columns = visible.flatten(0, 2).any(0).nonzero()
    return int(columns.max()) + 1


def _version(value: Any) -> int | None:
    """A tensor's in-place version counter (None: not a tensor, or an inference tensor, which
    has none)."""
    if not isinstance(value, torch.Tensor) or value.is_inference():
        return None
    return int(value._version)


def plain_key_extras(extras: Iterable[Any], total: int) -> bool:
    """No argument of three or more axes over the keys but per-query 4-D ones (which blocks cut
    to the keys they see)."""
    return not any(isinstance(extra, torch.Tensor) and extra.ndim >= 3 and total in extra.shape
                   and not (extra.ndim == 4 and extra.shape[-1] == total) for extra in extras)


def _key_columns(value: Any, total: int, seen: int) -> Any:
    """The first `seen` key columns of a per-query 4-D tensor over all `total` keys."""
    if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[-1] == total:
        return value[..., :seen]
    return value


def _query_rows(value: Any, start: int, stop: int, length: int) -> Any:
    """Rows start:stop of a per-query 4-D tensor (B|1, H|1, L, S): masks, position biases.
    Anything else (scalars, sinks, position ids, broadcast rows) passes unchanged."""
    if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[2] == length:
        return value[:, :, start:stop]
    return value

