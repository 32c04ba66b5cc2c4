"""Every storage of a torch zip checkpoint checked against its record, before any value is read.

`torch.load(mmap=True)` cuts each storage out of one map of the whole file as
``[record offset, record offset + declared bytes)``: the pickle declares the size, the archive
holds the record, and nothing compares them. A record shorter than its declaration, a tensor
whose offset lies past its record, or two directory entries pointing at the same bytes would
make a weight read another tensor's bytes. So before `torch.load` runs:

- the archive's records are read with torch's own zip reader (the offsets mmap will use) and
  must agree with Python's reading of the same directory (names, sizes, stored, data offsets);
- the stored data of distinct records never overlap and lie inside the file;
- ``data.pkl`` is unpickled a first time with torch's own weights-only unpickler (the same
  allow-list, so nothing can run), each storage standing in as a meta-device storage of its
  declared size: every storage must name an existing record whose size is its declared size,
  one key is used with one dtype, and every tensor's extent lies inside its storage.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import CheckpointError, printable_path, quoted
from attnviz.load.paths import native_path

if TYPE_CHECKING:
    import torch

MAX_PICKLE_BYTES = 256 * 1024 * 1024  # data.pkl: names, shapes and offsets (MBs for huge models)
MAX_OBJECTS = 10_000_000  # objects visited in the unpickled tree
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, …, name length, extra length
_BAD = "the file is not a safe PyTorch zip checkpoint"


@dataclass(frozen=True)
class Record:
    """One archive record as torch's reader sees it: where its data starts and how long it is."""

    name: str
    offset: int
    size: int


def check_zip_storages(path: Path) -> None:
    """Refuse a zip checkpoint whose storages could read bytes that are not theirs."""
    where = printable_path(path)
    records = read_records(path, where)
    check_no_overlap(records, path.stat().st_size, where)
    if "data.pkl" not in records:
        raise CheckpointError(f"{_BAD}: no data.pkl record", where=where)
    pickle_record = records["data.pkl"]
    if pickle_record.size > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{_BAD}: data.pkl holds {pickle_record.size} bytes "
                              f"(at most {MAX_PICKLE_BYTES} are read)", where=where)
    with open(path, "rb") as f:
        f.seek(pickle_record.offset)
        data = f.read(pickle_record.size)
    ShadowLoad(records, where).run(data)


def read_records(path: Path, where: str) -> dict[str, Record]:
    """Records by name (without the top folder), checked between torch's and Python's readers."""
    import torch

    try:
        reader: Any = torch._C.PyTorchFileReader(native_path(path))
        names = list(reader.get_all_records())
        seen = {name: Record(name, int(reader.get_record_offset(name)),
                             int(reader.get_record_size(name))) for name in names}
    except Exception as exc:  # torch raises RuntimeError/ValueError for damaged archives
        raise CheckpointError(f"{_BAD}: torch cannot read its zip directory "
                              f"({type(exc).__name__})", where=where) from None
    python_view = _python_records(path, where)
    if set(python_view) != set(seen):
        odd = sorted(set(python_view) ^ set(seen))[0]
        raise CheckpointError(f"{_BAD}: its zip directory reads differently in torch and in "
                              f"Python (record {quoted(odd)})", where=where)
    for name, record in seen.items():
        if python_view[name] != record:
            raise CheckpointError(f"{_BAD}: record {quoted(name)} has two readings "
                                  "(a forged zip directory)", where=where)
    return seen


def _python_records(path: Path, where: str) -> dict[str, Record]:
    """Records as Python's zipfile reads the central directory, data offsets from local headers."""
    found: dict[str, Record] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for entry in archive.infolist():
            f.seek(entry.header_offset)
            head = f.read(_LOCAL_HEADER.size)
            if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{_BAD}: entry {quoted(entry.filename)} has no local "
                                      "header where the directory says", where=where)
            _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
            offset = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            name = entry.filename.split("/", 1)[1] if "/" in entry.filename else entry.filename
            if name in found:
                raise CheckpointError(f"{_BAD}: record {quoted(name)} appears twice",
                                      where=where)
            found[name] = Record(name, offset, entry.file_size)
    return found


def check_no_overlap(records: dict[str, Record], file_size: int, where: str) -> None:
    """Stored data of distinct records lie inside the file and never share a byte."""
    spans = sorted((r for r in records.values() if r.size > 0), key=lambda r: r.offset)
    for record in spans:
        if record.offset < 0 or record.offset + record.size > file_size:
            raise CheckpointError(f"{_BAD}: record {quoted(record.name)} claims bytes past the "
                                  "end of the file", where=where)
    for before, after in zip(spans, spans[1:], strict=False):
        if before.offset + before.size > after.offset:
            raise CheckpointError(f"{_BAD}: records {quoted(before.name)} and "
                                  f"{quoted(after.name)} share bytes (a forged zip directory)",
                                  fix="re-save the checkpoint with torch.save", where=where)


@dataclass
class _Storage:
    name: str
    dtype: Any
    nbytes: int


class ShadowLoad:
    """data.pkl unpickled with meta storages: declarations checked, no data read."""

    def __init__(self, records: dict[str, Record], where: str) -> None:
        self.records = records
        self.where = where
        self.by_key: dict[str, Any] = {}  # key → meta TypedStorage (torch caches by key too)
        self.by_impl: dict[int, _Storage] = {}
        self.device = "meta"

    def run(self, data: bytes) -> None:
        """Meta stand-ins first (no memory); a rebuild meta tensors cannot take (a sparse
        tensor's) is retried with uninitialized CPU storages, whose sizes were checked against
        their records first (so at most the file's size is reserved) and whose bytes are never
        read. Sparse tensors the retry queued for torch's validation are taken off its list."""
        import pickle

        import torch._utils

        try:
            self._run(data, "meta")
        except (CheckpointError, pickle.UnpicklingError):
            raise
        except Exception:
            queued = len(torch._utils._sparse_tensors_to_validate)
            self.by_key.clear()
            self.by_impl.clear()
            try:
                self._run(data, "cpu")
            finally:
                del torch._utils._sparse_tensors_to_validate[queued:]

    def _run(self, data: bytes, device: str) -> None:
        import torch._weights_only_unpickler as wo

        shadow = self
        self.device = device

        class _Unpickler(wo.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return shadow.storage(pid)

        result = _Unpickler(io.BytesIO(data), encoding="utf-8").load()
        for key, tensor in _tensors(result):
            self.check_extent(key, tensor)

    def storage(self, pid: Any) -> Any:
        """The meta stand-in for one declared storage, after checking it against its record."""
        import torch

        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise CheckpointError(f"{_BAD}: a storage reference of an unknown form",
                                  where=self.where)
        _, storage_type, key, _, numel = pid
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise CheckpointError(f"{_BAD}: storage key {quoted(str(key))} or its size "
                                  f"{quoted(str(numel))} is malformed", where=self.where)
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        elif isinstance(storage_type, torch.serialization.StorageType):
            dtype = storage_type.dtype
        else:
            raise CheckpointError(f"{_BAD}: storage {quoted(key)} has no storage type",
                                  where=self.where)
        nbytes = numel * torch._utils._element_size(dtype)
        name = f"data/{key}"
        if key in self.by_key:
            known = self.by_key[key]
            declared = self.by_impl[known._untyped_storage._cdata]
            if declared.dtype != dtype or declared.nbytes != nbytes:
                raise CheckpointError(
                    f"{_BAD}: storage {quoted(key)} is declared twice, as {declared.dtype} "
                    f"({declared.nbytes} bytes) and as {dtype} ({nbytes} bytes)",
                    where=self.where)
            return known
        record = self.records.get(name)
        if record is None:
            raise CheckpointError(f"{_BAD}: storage {quoted(key)} has no record "
                                  f"{quoted(name)}", where=self.where)
        if record.size != nbytes:
            raise CheckpointError(
                f"{_BAD}: storage {quoted(key)} declares {numel} × {dtype} = {nbytes} bytes "
                f"but its record holds {record.size} (its tensors would read other bytes)",
                fix="re-save the checkpoint with torch.save", where=self.where)
        untyped = torch.UntypedStorage(nbytes, device=self.device)
        typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        self.by_key[key] = typed
        self.by_impl[untyped._cdata] = _Storage(name, dtype, nbytes)
        return typed

    def check_extent(self, key: str, tensor: torch.Tensor) -> None:
        """The bytes a tensor spans lie inside the storage its pickle names (sparse and other
        layouts are refused by name after loading, before any value is read)."""
        import torch

        if tensor.layout != torch.strided:
            return
        storage = self.by_impl.get(tensor.untyped_storage()._cdata)
        if storage is None:  # not backed by a record (no data, or built from the pickle)
            return
        lowest, highest = tensor_span(tuple(tensor.shape), tuple(tensor.stride()),
                                      int(tensor.storage_offset()))
        size = tensor.element_size()
        if tensor.numel() and (lowest < 0 or highest * size > storage.nbytes):
            raise CheckpointError(
                f"{_BAD}: tensor {quoted(key)} spans bytes {max(lowest, 0) * size}–"
                f"{highest * size} of storage {quoted(storage.name)}, which holds "
                f"{storage.nbytes}", fix="re-save the checkpoint with torch.save",
                where=self.where)


def tensor_span(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> tuple[int, int]:
    """Elements [lowest, highest) a strided view touches (for a view with at least one element)."""
    lowest = highest = offset
    for length, step in zip(shape, stride, strict=True):
        reach = (length - 1) * step
        lowest += min(reach, 0)
        highest += max(reach, 0)
    return lowest, highest + 1


def _tensors(root: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in an unpickled tree, named by its path, without recursion."""
    import torch

    stack: list[tuple[str, object]] = [("", root)]
    seen: set[int] = set()
    while stack:
        path, obj = stack.pop()
        if not isinstance(obj, torch.Tensor | dict | list | tuple | set) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > MAX_OBJECTS:
            raise CheckpointError(f"{_BAD}: more than {MAX_OBJECTS} objects in its pickle")
        if isinstance(obj, torch.Tensor):
            yield path or "(root)", obj
        elif isinstance(obj, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in obj.items())
        elif isinstance(obj, list | tuple | set):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
