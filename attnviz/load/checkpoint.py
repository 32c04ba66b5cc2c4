"""Checkpoint files and folders → a `TensorStore`, lazily and safely: `open_checkpoint` picks the
format (a safetensors file, a torch pickle, a Hugging Face folder, sharded or not) and reads
headers only. The formats live beside this module (store, safetensors_file, pickles); their
public names are re-exported here.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.errors import (
    CheckpointError,
    UsageError,
    printable,
    printable_path,
    quoted,
)
from attnviz.load.jsonfile import parse_json
from attnviz.load.paths import check_path_text, stat_input

if TYPE_CHECKING:
    import numpy as np
    import torch

from attnviz.load.pickles import (  # noqa: F401 - re-exported
    MIN_TORCH_FOR_PICKLES,
    PICKLE_SUFFIXES,
    PickleStore,
    check_pickled_tensor,
    check_torch_zip,
    flatten_state_dict,
    load_pickle_tensors,
)
from attnviz.load.safetensors_file import (  # noqa: F401 - re-exported
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    SAFETENSORS_SUFFIX,
    SafetensorsStore,
    as_float32,
    check_regular_file,
    read_safetensors_header,
)
from attnviz.load.store import (  # noqa: F401 - re-exported
    DTYPE_SIZES,
    FLOAT_DTYPES,
    DictStore,
    TensorInfo,
    TensorStore,
    normalize_names,
    torch_dtype_name,
)


class ShardedStore(TensorStore):
    """Several files behind one name space (an HF index); shards are opened on first use."""

    def __init__(self, folder: Path, weight_map: dict[str, str], fmt: str,
                 config: dict[str, Any] | None) -> None:
        super().__init__(str(folder), fmt, config)  # exact: --json and --export carry it
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

    def numpy_view(self, name: str) -> np.memmap | None:
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
    check_regular_file(path)
    return path


def read_json(path: Path, what: str) -> dict[str, Any]:
    check_regular_file(path)
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
            odd = next((v for v in weight_map.values()
                        if not v.lower().endswith((SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES))), None)
            if odd is not None:  # the folder's content, not the command line: bad data
                raise CheckpointError(f"{index_name} names {quoted(odd)} as a shard, which is "
                                      "not a weights file (.safetensors, .bin, .pt)",
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

