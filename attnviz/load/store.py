"""The store protocol: named tensors of one checkpoint, shapes and dtypes without reading data,
tensors (or blocks of rows) read only when asked."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import (
    CheckpointError,
    quoted,
)

if TYPE_CHECKING:
    import numpy as np
    import torch


WRAPPER_PREFIXES = ("module.", "_orig_mod.")

# safetensors dtype name → bytes per element
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
    "F8_E8M0": 1, "C64": 8, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}  # fmt: skip
# bits per element of the packed sub-byte types safetensors also writes (F4: two per byte)
SUB_BYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ",
                          "F8_E5M2FNUZ"})
# integer and boolean tensors are ordinary buffers (position ids, masks, counters)
PLAIN_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})


def skipped_dtype(dtype: str) -> bool:
    """A dtype attnviz computes nothing with (C64, F8_E8M0, F4, a torch dtype safetensors has
    no name for): its tensors are listed as skipped, and refused only where one is needed."""
    return dtype not in FLOAT_DTYPES and dtype not in PLAIN_DTYPES


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    offsets: tuple[int, int] | None = None  # byte range in a safetensors data section

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorStore:
    """Named tensors of one checkpoint. Subclasses implement `_info` and `_read`."""

    def __init__(self, source: str, fmt: str, config: dict[str, Any] | None = None) -> None:
        self.source = source
        self.format = fmt
        self.config: dict[str, Any] = config or {}
        self.metadata: dict[str, str] = {}
        self.folder: Path | None = None  # the model folder, when opened as one (vocab files)
        self._names: dict[str, str] = {}  # normalized name → raw name

    def _set_names(self, raw_names: Iterable[str]) -> None:
        self._names = normalize_names(raw_names)

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def info(self, name: str) -> TensorInfo:
        return self._info(self._raw(name))

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, on the CPU."""
        return self._read(self._raw(name), None)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the first axis (reading only those rows where the format can)."""
        return self._read(self._raw(name), (start, stop))

    def _raw(self, name: str) -> str:
        try:
            return self._names[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {quoted(name)} is not in the checkpoint", where=self.source
            ) from None

    def _info(self, raw: str) -> TensorInfo:
        raise NotImplementedError

    def numpy_view(self, name: str) -> np.memmap | None:
        """A memory-mapped numpy view of the tensor where the format allows, else None."""
        return None

    def _read(self, raw: str, rows: tuple[int, int] | None) -> torch.Tensor:
        raise NotImplementedError


def normalize_names(raw_names: Iterable[str]) -> dict[str, str]:
    """Strip wrapper prefixes (DDP's `module.`, torch.compile's `_orig_mod.`) all names share."""
    raw = list(raw_names)
    names = {name: name for name in raw}
    for prefix in WRAPPER_PREFIXES:
        if raw and all(name.startswith(prefix) for name in names):
            names = {name[len(prefix) :]: original for name, original in names.items()}
    return names


class DictStore(TensorStore):
    """Tensors already in memory (random initialization, tests)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], source: str = "<memory>",
                 fmt: str = "memory", config: dict[str, Any] | None = None) -> None:
        super().__init__(source, fmt, config)
        self._tensors = dict(tensors)
        self._set_names(self._tensors)

    def _info(self, raw: str) -> TensorInfo:
        tensor = self._tensors[raw]
        return TensorInfo(tuple(tensor.shape), torch_dtype_name(tensor.dtype))

    def _read(self, raw: str, rows: tuple[int, int] | None) -> torch.Tensor:
        tensor = self._tensors[raw]
        return tensor if rows is None else tensor[rows[0] : rows[1]]


def torch_dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name for a torch dtype ("F32" for torch.float32)."""
    import torch

    names = {
        torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL",
    }  # fmt: skip
    for name, short in (("complex64", "C64"), ("float8_e8m0fnu", "F8_E8M0"),
                        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                        ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
                        ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
        if getattr(torch, name, None) == dtype:
            return short
    return names.get(dtype, str(dtype).removeprefix("torch."))

