"""safetensors files: the header parsed and checked here, with size caps, before the library
ever maps the file; data memory-mapped on first read."""

from __future__ import annotations

import math
import os
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import (
    CheckpointError,
    from_os_error,
    printable_path,
    quoted,
)
from attnviz.load.jsonfile import parse_json
from attnviz.load.paths import native_path

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import ArrayLike, NDArray
    from safetensors import safe_open

from attnviz.load.store import DTYPE_SIZES, SUB_BYTE_BITS, TensorInfo, TensorStore

MAX_HEADER_BYTES = 64 * 1024 * 1024  # a 100 GB checkpoint's header is well under 1 MB
MAX_TENSORS = 200_000
SAFETENSORS_SUFFIX = ".safetensors"


def check_regular_file(path: Path) -> os.stat_result:
    try:
        st = path.stat()
    except OSError as exc:
        raise from_os_error(exc, "cannot read the file") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError("not a regular file", fix="pass a checkpoint file or model folder",
                              where=printable_path(path))
    return st


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate a safetensors header: (tensors, metadata, data start)."""
    where = printable_path(path)
    size = check_regular_file(path).st_size
    bad = "the file is not a valid safetensors checkpoint"
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{bad}: shorter than its 8-byte header length", where=where)
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{bad}: header of {header_len} bytes exceeds the "
                                  f"{MAX_HEADER_BYTES}-byte limit", where=where)
        if 8 + header_len > size:
            raise CheckpointError(f"{bad}: header runs past the end of the file (truncated?)",
                                  where=where)
        raw = f.read(header_len)
    try:
        header = parse_json(raw, "the header", where, finite=False)
    except CheckpointError as exc:
        raise CheckpointError(f"{bad}: {exc.what}", where=where) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad}: header is not a JSON object", where=where)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{bad}: __metadata__ must map strings to strings", where=where)
    if len(header) > MAX_TENSORS:
        raise CheckpointError(f"{bad}: {len(header)} tensors exceed the limit of {MAX_TENSORS}",
                              where=where)
    data_len = size - 8 - header_len
    tensors = {name: _parse_entry(name, entry, data_len, where) for name, entry in header.items()}
    _check_offsets(header, data_len, where)
    return tensors, metadata, 8 + header_len


def _parse_entry(name: str, entry: object, data_len: int, where: str) -> TensorInfo:
    bad = f"the safetensors header entry for {quoted(name)} is invalid"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{bad}: not an object", where=where)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES and dtype not in SUB_BYTE_BITS:  # safetensors refuses it too
        raise CheckpointError(f"{bad}: unknown dtype {quoted(str(dtype))}", where=where)
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointError(f"{bad}: shape must be a list of non-negative integers", where=where)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise CheckpointError(f"{bad}: data offsets outside the file's data", where=where)
    # a dtype attnviz computes nothing with (C64, F8_E8M0, F4) is kept by name: only a
    # tensor attnviz needs is refused for it (recognize.base.ref)
    bits = 8 * DTYPE_SIZES[dtype] if dtype in DTYPE_SIZES else SUB_BYTE_BITS[dtype]
    if 8 * (offsets[1] - offsets[0]) != math.prod(shape) * bits:
        raise CheckpointError(f"{bad}: shape {tuple(shape)} of {dtype} does not match its "
                              f"{offsets[1] - offsets[0]} bytes", where=where)
    return TensorInfo(tuple(shape), dtype, (offsets[0], offsets[1]))


def _check_offsets(header: dict[str, Any], data_len: int, where: str) -> None:
    spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())
    end = 0
    for begin, stop in spans:
        if begin < end:
            raise CheckpointError("the file is not a valid safetensors checkpoint: tensors "
                                  "overlap", where=where)
        if begin > end:
            raise CheckpointError("the file is not a valid safetensors checkpoint: a gap "
                                  "between tensors", where=where)
        end = stop
    if end != data_len:
        raise CheckpointError(f"the file is not a valid safetensors checkpoint: its tensors "
                              f"cover {end} of {data_len} data bytes", where=where)


class SafetensorsStore(TensorStore):
    """A .safetensors file: header parsed up front, data memory-mapped on first read."""

    def __init__(self, path: Path, config: dict[str, Any] | None = None) -> None:
        super().__init__(str(path), "safetensors", config)  # exact: data outputs carry it
        self.path = path
        self._tensors, self.metadata, self._data_start = read_safetensors_header(path)
        self._handle: safe_open | None = None
        self._set_names(self._tensors)

    def _info(self, raw: str) -> TensorInfo:
        return self._tensors[raw]

    def numpy_view(self, name: str) -> np.memmap | None:
        """A read-only memory map of a float tensor, without torch (None for other dtypes).

        bfloat16 comes back as its raw uint16 bits: `as_float32` widens a slice of it.
        """
        return self._numpy_raw(self._raw(name))

    def _numpy_raw(self, raw: str) -> np.memmap | None:
        import numpy as np

        info = self._tensors[raw]
        dtype = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
                 "BF16": np.uint16}.get(info.dtype)
        if dtype is None or info.offsets is None or info.numel == 0:
            return None
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start +
                         info.offsets[0], shape=info.shape)

    def _read(self, raw: str, rows: tuple[int, int] | None) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            if self._handle is None:
                self._handle = safe_open(native_path(self.path), framework="pt", device="cpu")
            if rows is None:
                return self._handle.get_tensor(raw)
            return self._handle.get_slice(raw)[rows[0] : rows[1]]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read tensor {quoted(raw)}: "
                                  f"{type(exc).__name__}", fix="the file may be damaged",
                                  where=self.source) from None


def as_float32(block: ArrayLike, dtype: str) -> NDArray[np.float32]:
    """A float32 numpy copy of a slice of `numpy_view` output."""
    import numpy as np

    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (np.asarray(block, dtype=np.uint32) << 16).view(np.float32)
    return np.asarray(block, dtype=np.float32)

