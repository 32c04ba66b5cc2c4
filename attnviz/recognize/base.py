"""Helpers shared by recognition: key matching, head hints, tensor references."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from attnviz.core.layer import AttentionLayer
from attnviz.core.request import HeadHints  # the request's, shared
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import DtypeError, LayoutError, printable, quoted
from attnviz.load.store import FLOAT_DTYPES, TensorStore


@dataclass(frozen=True)
class Unresolved:
    """An attention module a family recognizes but cannot split into heads without more facts
    (fused q/k/v whose row layout depends on the head count or on config.json): listed by
    inspect with what is missing, never guessed and never an error for the whole checkpoint."""

    name: str  # module prefix, without the trailing dot
    family: str
    keys: tuple[str, ...]  # the tensors it would claim
    reason: str  # what cannot be located, and why
    fix: str  # how to supply what is missing
    data: bool = False  # the file's data is the problem (a dtype), not a missing fact

    @property
    def what(self) -> str:
        """The error text when this layer is asked for: its name and the reason."""
        return f"{printable(self.name)}: {self.reason}" if self.name else self.reason


def prefixes_with(keys: Iterable[str], suffix: str) -> list[str]:
    """Every prefix P (including its trailing dot, or "") such that P + suffix is a key."""
    found = []
    for key in keys:
        if key == suffix:
            found.append("")
        elif key.endswith("." + suffix):
            found.append(key[: -len(suffix)])
    return sorted(set(found), key=natural_key)


def natural_key(name: str) -> list[Any]:
    """Sort "layer.10" after "layer.9" (numbers compared by length, then digits: a
    5000-digit number in a name is past what int() converts)."""
    return [(len(part.lstrip("0")), part.lstrip("0"), part) if index % 2 else part
            for index, part in enumerate(re.split(r"([0-9]+)", name))]


def layer_index(prefix: str) -> int | None:
    """The last integer in a prefix ("encoder.layer.3.attention." → 3), for per-layer configs."""
    numbers = re.findall(r"\.([0-9]+)\.", "." + prefix)
    return int(numbers[-1]) if numbers and len(numbers[-1]) <= 18 else None


def ref(store: TensorStore, key: str, *, transposed: bool = False,
        rows: tuple[tuple[int, int], ...] | None = None, flatten: bool = False) -> TensorRef:
    """A reference to `key`, refusing tensors that cannot be attention weights."""
    info = store.info(key)
    if 0 in info.shape:  # a zero-sized axis holds no data, so the file cannot bound the others
        raise LayoutError(f"attention tensor {quoted(key)} has shape {info.shape}, with a "
                          "zero-sized dimension", fix="the checkpoint is damaged or not a model",
                          where=store.source)
    if info.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"attention tensor {quoted(key)} has dtype {info.dtype}, not a "
                          "floating-point type", fix="the checkpoint is not a float model",
                          where=store.source)
    expected_dims = 1 if key.endswith("bias") and not flatten else None
    if expected_dims and len(info.shape) != 1:
        raise LayoutError(f"bias {quoted(key)} has shape {info.shape}, expected 1-D",
                          where=store.source)
    if not flatten and not key.endswith("bias") and len(info.shape) != 2:
        raise LayoutError(f"weight {quoted(key)} has shape {info.shape}, expected 2-D",
                          where=store.source)
    return TensorRef(key, info.shape, info.dtype, transposed, rows, flatten)


def optional_ref(store: TensorStore, key: str, **kwargs: Any) -> TensorRef | None:
    return ref(store, key, **kwargs) if key in store else None


def metadata_int(store: TensorStore, name: str) -> int | None:
    value = store.metadata.get(name)
    if value is None:
        return None
    # ASCII digits only: str.isdigit() also accepts "²" and "١٢", and a 5000-digit string is
    # past what int() converts; no count attnviz uses needs more than 18 digits.
    if not re.fullmatch(r"[0-9]{1,18}", value) or int(value) <= 0:
        raise LayoutError(f"safetensors metadata {name!r} is {quoted(value)}, expected a "
                          "positive integer", where=store.source)
    return int(value)


def finish(layer: AttentionLayer, heads: HeadHints, source: str) -> AttentionLayer:
    """Set head counts on a freshly built layer, naming the checkpoint when they contradict it."""
    try:
        return layer.with_heads(heads.num_heads, heads.num_kv_heads, heads.head_dim)
    except LayoutError as exc:
        exc.where = exc.where or source
        raise
