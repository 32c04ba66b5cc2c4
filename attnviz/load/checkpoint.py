"""Checkpoint files → named tensors, lazily and safely.

A `TensorStore` answers shapes and dtypes without reading tensor data (safetensors headers are
parsed here, with size caps, before the library ever maps the file) and reads a tensor, or a block
of its rows, only when asked. Pickle checkpoints go through `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import (
    CheckpointError,
    UsageError,
    from_os_error,
    printable,
    printable_path,
    quoted,
)
from attnviz.load.jsonfile import parse_json
from attnviz.load.paths import check_path_text, stat_input

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 64 * 1024 * 1024  # a 100 GB checkpoint's header is well under 1 MB
MAX_TENSORS = 200_000
MAX_ZIP_ENTRIES = 500_000
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
NESTING_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "weights")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"
MIN_TORCH_FOR_PICKLES = (2, 10)

# safetensors dtype name → bytes per element
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3"})


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

    def numpy_view(self, name: str) -> Any | None:
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


def torch_dtype_name(dtype: Any) -> str:
    """safetensors' name for a torch dtype ("F32" for torch.float32)."""
    import torch

    names = {
        torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL",
    }  # fmt: skip
    return names.get(dtype, str(dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------------------------
# safetensors


def _check_regular_file(path: Path) -> os.stat_result:
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
    size = _check_regular_file(path).st_size
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


def _parse_entry(name: str, entry: Any, data_len: int, where: str) -> TensorInfo:
    bad = f"the safetensors header entry for {quoted(name)} is invalid"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{bad}: not an object", where=where)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{bad}: unknown dtype {quoted(str(dtype))}", where=where)
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointError(f"{bad}: shape must be a list of non-negative integers", where=where)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise CheckpointError(f"{bad}: data offsets outside the file's data", where=where)
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
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
        super().__init__(printable_path(path), "safetensors", config)
        self.path = path
        self._tensors, self.metadata, self._data_start = read_safetensors_header(path)
        self._handle: Any = None
        self._set_names(self._tensors)

    def _info(self, raw: str) -> TensorInfo:
        return self._tensors[raw]

    def numpy_view(self, name: str) -> Any | None:
        """A read-only memory map of a float tensor, without torch (None for other dtypes).

        bfloat16 comes back as its raw uint16 bits: `as_float32` widens a slice of it.
        """
        return self._numpy_raw(self._raw(name))

    def _numpy_raw(self, raw: str) -> Any | None:
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
                self._handle = safe_open(str(self.path), framework="pt", device="cpu")
            if rows is None:
                return self._handle.get_tensor(raw)
            return self._handle.get_slice(raw)[rows[0] : rows[1]]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read tensor {quoted(raw)}: "
                                  f"{type(exc).__name__}", fix="the file may be damaged",
                                  where=self.source) from None


def as_float32(block: Any, dtype: str) -> Any:
    """A float32 numpy copy of a slice of `numpy_view` output."""
    import numpy as np

    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (np.asarray(block, dtype=np.uint32) << 16).view(np.float32)
    return np.asarray(block, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# torch pickles


def check_torch_zip(path: Path) -> bool:
    """Refuse zip checkpoints that could decompress into a bomb or lie about sizes.

    Returns False for files that are not zip archives (legacy torch format or raw pickles).
    """
    where = printable_path(path)
    size = _check_regular_file(path).st_size
    bad = "the file is not a safe PyTorch zip checkpoint"
    try:
        if not zipfile.is_zipfile(path):
            return False
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError):
        raise CheckpointError(f"{bad}: damaged zip directory", where=where) from None
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError):
        raise CheckpointError(f"{bad}: damaged zip directory", where=where) from None
    if len(entries) > MAX_ZIP_ENTRIES:
        raise CheckpointError(f"{bad}: {len(entries)} entries", where=where)
    tops = set()
    for entry in entries:
        parts = entry.filename.split("/")
        if entry.filename.startswith("/") or ".." in parts or "\\" in entry.filename:
            raise CheckpointError(f"{bad}: entry name {quoted(entry.filename)}", where=where)
        tops.add(parts[0])
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise CheckpointError(f"{bad}: entry {quoted(entry.filename)} is compressed "
                                  "(torch never compresses; this may be a decompression bomb)",
                                  fix="re-save it with torch.save or convert it to safetensors",
                                  where=where)
        if entry.header_offset + entry.file_size > size:
            raise CheckpointError(f"{bad}: entry {quoted(entry.filename)} claims more bytes "
                                  "than the file holds", where=where)
    if len(tops) > 1:
        raise CheckpointError(f"{bad}: entries under several top folders", where=where)
    return True


def _require_safe_torch() -> None:
    import torch

    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH_FOR_PICKLES:
        raise CheckpointError(
            f"loading pickle checkpoints safely needs torch >= 2.10, this is {torch.__version__}",
            fix="upgrade torch, or convert the checkpoint to .safetensors",
        )


def load_pickle_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a torch pickle, with weights_only=True always passed explicitly."""
    import pickle

    import torch

    _require_safe_torch()
    where = printable_path(path)
    is_zip = check_torch_zip(path)
    try:
        # weights_only is passed explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only overrides a
        # missing argument. No pickle_module, no safe globals, and no retry without it.
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"refused to unpickle: the file needs {_unsafe_globals(path)}, which could run code",
            fix="convert it to .safetensors in a trusted environment", where=where) from None
    except Exception as exc:  # torch raises many types for damaged files; none are ours to show
        raise CheckpointError(f"not a readable PyTorch checkpoint ({type(exc).__name__})",
                              fix="check that the file is a complete torch.save output",
                              where=where) from None
    tensors = flatten_state_dict(obj)
    if not tensors:
        raise CheckpointError("the checkpoint holds no tensors", where=where)
    for name, tensor in tensors.items():
        check_pickled_tensor(name, tensor, where)
    return tensors


def check_pickled_tensor(name: str, tensor: torch.Tensor, where: str) -> None:
    """A pickled tensor must be dense data attnviz can read within what the file holds.

    A pickle names each tensor's storage, offset, shape and strides separately: shape
    (100000, 100000) with strides (0, 0) over a 4-byte storage loads from a 1.7 KB file as a
    view, and materializing it (.float(), .contiguous()) would take 40 GB. Its size is checked
    against its storage's before anything reads it; meta tensors (a shape, no data) and sparse
    layouts are refused by name.
    """
    import torch

    shown = quoted(name)
    if tensor.device.type == "meta":
        raise CheckpointError(f"tensor {shown} is a meta tensor: it has a shape but no data",
                              fix="save the state dict of a model whose weights were loaded",
                              where=where)
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        raise CheckpointError(f"tensor {shown} is a {layout} tensor, not a dense one",
                              fix="save dense tensors (tensor.to_dense())", where=where)
    needed = tensor.numel() * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if needed > held:
        raise CheckpointError(f"tensor {shown} has shape {tuple(tensor.shape)} ({needed} bytes) "
                              f"but views only {held} bytes of data (strides "
                              f"{tuple(tensor.stride())}: repeated or overlapping)",
                              fix="re-save it from a dense copy (tensor.contiguous().clone())",
                              where=where)


def _unsafe_globals(path: Path) -> str:
    import torch

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # it reads zip checkpoints only
        names = _scan_pickle_globals(path)
    if not names:
        return "objects that are not plain tensors"
    shown = ", ".join(printable(name, 60) for name in names[:3])
    return f"the global{'s' if len(names) > 1 else ''} {shown}"


def _scan_pickle_globals(path: Path, limit: int = 16 * 1024 * 1024) -> list[str]:
    """Globals a raw or legacy-format pickle names, read by opcode (nothing is executed)."""
    import io
    import pickletools

    try:
        import torch._weights_only_unpickler as wo

        allowed = set(wo._get_allowed_globals())
    except (ImportError, AttributeError):
        allowed = set()
    with open(path, "rb") as f:
        stream = io.BytesIO(f.read(limit))
    found: list[str] = []
    strings: list[str] = []
    try:
        while stream.tell() < len(stream.getbuffer()):
            for opcode, arg, _ in pickletools.genops(stream):
                if opcode.name == "GLOBAL":
                    found.append(str(arg).replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # damaged or ended: report what was seen
        pass
    return [name for name in dict.fromkeys(found) if name not in allowed]


def flatten_state_dict(obj: Any) -> dict[str, torch.Tensor]:
    """Find the state dict inside a loaded checkpoint ({"state_dict": …}, {"model": …}, bare)."""
    import torch

    if isinstance(obj, torch.nn.Module):  # unreachable with weights_only, kept for clarity
        return {}
    if not isinstance(obj, Mapping):
        return {}
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if tensors:
        return tensors
    for key in NESTING_KEYS:
        if isinstance(obj.get(key), Mapping):
            found = flatten_state_dict(obj[key])
            if found:
                return found
    return {}


class PickleStore(DictStore):
    """A .pt/.pth/.bin file loaded with weights_only=True (zip files memory-mapped)."""

    def __init__(self, path: Path, config: dict[str, Any] | None = None) -> None:
        super().__init__(load_pickle_tensors(path), printable_path(path), "torch", config)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


class ShardedStore(TensorStore):
    """Several files behind one name space (an HF index); shards are opened on first use."""

    def __init__(self, folder: Path, weight_map: dict[str, str], fmt: str,
                 config: dict[str, Any] | None) -> None:
        super().__init__(printable_path(folder), fmt, config)
        self.folder = folder
        self._folder = folder
        self._weight_map = weight_map
        self._shards: dict[str, TensorStore] = {}
        for file_name in sorted(set(weight_map.values())):
            safe_child(folder, file_name)  # every shard named must be a file inside the folder
        self._set_names(weight_map)

    def shard_of(self, raw: str) -> TensorStore:
        file_name = self._weight_map[raw]
        if file_name not in self._shards:
            path = safe_child(self._folder, file_name)
            self._shards[file_name] = open_file(path, self.config)
        shard = self._shards[file_name]
        if raw not in shard._names.values():
            raise CheckpointError(f"shard {quoted(file_name)} lacks tensor "
                                  f"{quoted(raw)} that the index promises",
                                  fix="re-download the model", where=self.source)
        return shard

    def _info(self, raw: str) -> TensorInfo:
        shard = self.shard_of(raw)
        return shard._info(raw)

    def numpy_view(self, name: str) -> Any | None:
        raw = self._raw(name)
        shard = self.shard_of(raw)
        return shard._numpy_raw(raw) if isinstance(shard, SafetensorsStore) else None

    def _read(self, raw: str, rows: tuple[int, int] | None) -> torch.Tensor:
        return self.shard_of(raw)._read(raw, rows)

    @property
    def opened_shards(self) -> list[str]:
        return sorted(self._shards)


def safe_child(folder: Path, file_name: str) -> Path:
    """`folder/file_name`, refusing names that leave the folder or are not regular files."""
    where = printable_path(folder)
    if not isinstance(file_name, str) or not file_name or "/" in file_name or "\\" in file_name \
            or file_name in (".", ".."):
        raise CheckpointError(f"the index names shard {quoted(str(file_name))}, which is not "
                              "a plain file name inside the folder", where=where)
    path = folder / file_name
    try:
        target, home = path.resolve(), folder.resolve()
    except (OSError, RuntimeError):  # RuntimeError: Python < 3.13 on a symbolic link loop
        raise CheckpointError(f"shard {quoted(file_name)} is a symbolic link loop",
                              fix="re-download the model", where=where) from None
    # The Hugging Face cache links snapshots/<rev>/<file> to ../../blobs/<hash>: allow that, and
    # nothing else outside the folder.
    blobs = home.parent.parent / "blobs"
    inside = target.parent == home or (home.parent.name == "snapshots" and target.parent == blobs)
    if not inside:
        raise CheckpointError(f"shard {quoted(file_name)} resolves outside the folder",
                              where=where)
    if not path.exists():
        raise CheckpointError(f"shard {quoted(file_name)} named in the index is missing",
                              fix="re-download the model", where=where)
    _check_regular_file(path)
    return path


def read_json(path: Path, what: str) -> dict[str, Any]:
    _check_regular_file(path)
    if path.stat().st_size > MAX_HEADER_BYTES:
        raise CheckpointError(f"{what} is too large", where=printable_path(path))
    with open(path, "rb") as f:
        raw = f.read(MAX_HEADER_BYTES + 1)
    data = parse_json(raw, what, printable_path(path))
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} is not a JSON object", where=printable_path(path))
    return data


def open_hf_folder(folder: Path) -> TensorStore:
    store = _open_folder_weights(folder)
    store.folder = folder
    return store


def _open_folder_weights(folder: Path) -> TensorStore:
    config_path = folder / "config.json"
    config = read_json(config_path, "config.json") if config_path.exists() else None
    for index_name, fmt in (("model.safetensors.index.json", "safetensors"),
                            ("pytorch_model.bin.index.json", "torch")):
        if (folder / index_name).exists():
            index = read_json(folder / index_name, index_name)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise CheckpointError(f"{index_name} has no valid weight_map",
                                      fix="re-download the model", where=printable_path(folder))
            return ShardedStore(folder, weight_map, f"{fmt} (sharded)", config)
    candidates = [p for p in sorted(folder.iterdir())
                  if p.is_file() and p.name.endswith((SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES))]
    preferred = [p for p in candidates if p.name in ("model.safetensors", "pytorch_model.bin")]
    chosen = preferred[:1] or candidates
    if len(chosen) != 1:
        found = ", ".join(printable(p.name, 40) for p in candidates[:5]) or "none"
        raise CheckpointError(f"the folder holds {len(candidates)} checkpoint files ({found})",
                              fix="pass one file, or a Hugging Face model folder",
                              where=printable_path(folder))
    return open_file(chosen[0], config)


def open_file(path: Path, config: dict[str, Any] | None = None) -> TensorStore:
    name = path.name.lower()
    if name.endswith(SAFETENSORS_SUFFIX):
        return SafetensorsStore(path, config)
    if name.endswith(PICKLE_SUFFIXES):
        return PickleStore(path, config)
    raise UsageError(f"unknown checkpoint format {quoted(path.suffix or path.name)}",
                     fix="use .safetensors, .pt, .pth, .bin or a model folder",
                     where=printable_path(path))


def open_checkpoint(path: Path | str) -> TensorStore:
    """Open a checkpoint file or folder, reading headers only."""
    path = Path(path)
    check_path_text(path, "the checkpoint path")
    if stat.S_ISDIR(stat_input(path, "the checkpoint").st_mode):
        return open_hf_folder(path)
    return open_file(path)
