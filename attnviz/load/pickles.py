"""torch pickles (.pt/.pth/.bin/.ckpt): a zip pre-check, then `torch.load(weights_only=True)` only,
and every tensor checked against the storage it views."""

from __future__ import annotations

import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import (
    CheckpointError,
    printable,
    printable_path,
    quoted,
)

if TYPE_CHECKING:
    import torch

from attnviz.load.paths import native_path
from attnviz.load.pickle_records import check_zip_storages, tensor_span
from attnviz.load.safetensors_file import check_regular_file
from attnviz.load.store import DictStore

MAX_ZIP_ENTRIES = 500_000
NESTING_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "weights")
MAX_NESTING = 8  # {"state_dict": {"model": …}} levels searched for the tensors
# names of parameters in a state dict (`q_proj.weight`, `in_proj_bias`, `bias_k`)
_WEIGHT_NAME = re.compile(r"(weight|bias|bias_[kv])$")
MAX_MAPPINGS = 10_000  # mappings examined in all (an optimizer state holds one per parameter)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
MIN_TORCH_FOR_PICKLES = (2, 10)


def check_torch_zip(path: Path) -> bool:
    """Refuse zip checkpoints that could decompress into a bomb or lie about sizes.

    Returns False for files that are not zip archives (legacy torch format or raw pickles).
    """
    where = printable_path(path)
    size = check_regular_file(path).st_size
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
    return load_pickle_state(path)[0]


def load_pickle_state(path: Path) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The state dict of a torch pickle and the keys leading to it (`find_state_dict`)."""
    import pickle

    import torch

    _require_safe_torch()
    where = printable_path(path)
    is_zip = check_torch_zip(path)
    try:
        if is_zip:  # every storage against its record, before mmap slices the file
            check_zip_storages(path)
        # weights_only is passed explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only overrides a
        # missing argument. No pickle_module, no safe globals, and no retry without it.
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr
            warnings.simplefilter("ignore")
            obj = torch.load(native_path(path), map_location="cpu", weights_only=True,
                             mmap=is_zip)
    except CheckpointError:
        raise
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"refused to unpickle: the file needs {_unsafe_globals(path)}, which could run code",
            fix="convert it to .safetensors in a trusted environment", where=where) from None
    except Exception as exc:  # torch raises many types for damaged files; none are ours to show
        raise CheckpointError(f"not a readable PyTorch checkpoint ({type(exc).__name__})",
                              fix="check that the file is a complete torch.save output",
                              where=where) from None
    tensors, entry = find_state_dict(obj)
    if not tensors:
        raise CheckpointError("the checkpoint holds no tensors", where=where)
    for name, tensor in tensors.items():
        check_pickled_tensor(name, tensor, where)
    return tensors, entry


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
    lowest, highest = tensor_span(tuple(tensor.shape), tuple(tensor.stride()),
                                  int(tensor.storage_offset()))
    if tensor.numel() and (lowest < 0 or highest * tensor.element_size() > held):
        raise CheckpointError(f"tensor {shown} reaches past the {held} bytes of its storage "
                              f"(offset {tensor.storage_offset()}, shape {tuple(tensor.shape)}, "
                              f"strides {tuple(tensor.stride())})",
                              fix="re-save it from a dense copy (tensor.contiguous().clone())",
                              where=where)
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


def flatten_state_dict(obj: object) -> dict[str, torch.Tensor]:
    """The state dict inside a loaded checkpoint ({"state_dict": …}, {"model": …}, bare)."""
    return find_state_dict(obj)[0]


def find_state_dict(obj: object) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The mapping of named tensors that holds the weights, and the keys that lead to it (()
    for a bare state dict).

    A training checkpoint keeps its weights beside other entries: {"model": sd, "best_acc":
    tensor(0.93), "epoch": 7}. One top-level tensor must not hide the nested dict, so every
    mapping is a candidate and the one with the most tensors named like weights wins (`…weight`,
    `…bias`: an optimizer's per-parameter `exp_avg`, `exp_avg_sq`, `step` are not), then the one
    with the most tensors (ties: the shallower, then one under a usual key such as "state_dict"
    or "model", then the first). Searched
    breadth-first without recursion, at most MAX_NESTING levels deep and MAX_MAPPINGS mappings
    in all: a pickle can nest a dict 100,000 deep or hold millions of small ones.
    """
    import torch

    best: tuple[tuple[int, int, int, int], dict[str, torch.Tensor], tuple[str, ...]] | None = None
    level: list[tuple[tuple[str, ...], object]] = [((), obj)]
    seen = 0
    for depth in range(MAX_NESTING):
        deeper: list[tuple[tuple[str, ...], object]] = []
        for path, candidate in level:
            if not isinstance(candidate, Mapping) or seen >= MAX_MAPPINGS:
                continue
            seen += 1
            tensors = {k: v for k, v in candidate.items()
                       if isinstance(k, str) and isinstance(v, torch.Tensor)}
            usual = 0 if not path or path[-1] in NESTING_KEYS else 1
            weights = sum(1 for name in tensors if _WEIGHT_NAME.search(name))
            rank = (-weights, -len(tensors), depth, usual)
            if tensors and (best is None or rank < best[0]):
                best = (rank, tensors, path)
            deeper.extend(((*path, str(key)), value)
                          for key, value in candidate.items() if isinstance(value, Mapping))
        level = deeper
    return ({}, ()) if best is None else (best[1], best[2])


def entry_name(path: tuple[str, ...]) -> str:
    """How inspect names the entry the weights came from: `["model"]`, `["a"]["b"]`."""
    return "".join(f"[{quoted(part)}]" for part in path)


class PickleStore(DictStore):
    """A .pt/.pth/.bin file loaded with weights_only=True (zip files memory-mapped)."""

    def __init__(self, path: Path, config: dict[str, Any] | None = None) -> None:
        tensors, entry = load_pickle_state(path)
        # a nested state dict is named where the format is shown: `torch, weights in ["model"]`
        fmt = f"torch, weights in {entry_name(entry)}" if entry else "torch"
        super().__init__(tensors, str(path), fmt, config)  # exact
        self.entry = entry

