"""A Hugging Face model loaded offline: config and tokenizer first, checked, then the weights.

Never downloads, never runs repository code; the model is built on the meta device and its
shapes compared with the checkpoint before transformers allocates anything."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnviz.compute.forward_pass.device import resolve_device
from attnviz.core.choices import LayerKind
from attnviz.errors import (
    CheckpointError,
    ConfigError,
    LayoutError,
    UsageError,
    option,
    printable,
    printable_path,
    quoted,
)
from attnviz.load.checkpoint import open_checkpoint
from attnviz.load.paths import library_path
from attnviz.load.store import TensorStore
from attnviz.recognize import find_layers
from attnviz.sources.hf import capture, guard
from attnviz.sources.hf.versions import check_versions, install_hint

DTYPES = ("float32", "bfloat16", "float16", "auto")  # = core.choices.Dtype (a test keeps it)
# The model itself computes in its dtype; float32 must agree to rounding, half precision loosely.
TOLERANCE = {"float64": 1e-4, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
STACK_OF = {LayerKind.SELF: "enc", LayerKind.DECODER_SELF: "dec",
            LayerKind.CROSS: "cross"}
PATHS = {
    capture.CapturePath.INTERFACE: (
        "transformers attention interface: attnviz's attention function runs the layers shown "
        "through their module's own eager attention, the others through sdpa"),
    capture.CapturePath.OUTPUT_ATTENTIONS: (
        "output_attentions (eager): this model's modeling file does not use the attention "
        "interface, so the maps are the ones it returns when asked"),
}


def require_transformers() -> None:
    """Fail with the install hint when the Hugging Face extra is missing."""
    # attnviz never downloads: huggingface_hub reads this once, when it is first imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    if any(importlib.util.find_spec(name) is None for name in ("transformers", "tokenizers")):
        raise UsageError(f"{option('model')} needs the Hugging Face extra", fix=install_hint())
    check_versions()


@dataclass
class OpenedModel:
    """A model folder read and checked, its tokenizer loaded, its weights not yet: enough to
    encode the inputs and check every limit before the weights cost anything."""

    folder: Path  # the local model folder (or hub-cache snapshot)
    config: Any  # the transformers config object
    tokenizer: Any
    store: TensorStore  # attnviz's header-only view of the same files
    tower: str | None  # a multi-tower model (CLIP): the attribute of its text tower
    embedding_rows: int  # rows of the token embedding of the part that runs
    position_limit: int | None = None  # the most tokens its position embedding can number

    @property
    def encoder_decoder(self) -> bool:
        return bool(getattr(self.config, "is_encoder_decoder", False))


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (AutoModel: the base model, no head)
    tokenizer: Any
    folder: Path  # the local model folder (or hub-cache snapshot) the weights came from
    config: Any  # the transformers config object
    dtype: str
    path: capture.CapturePath  # how its maps are captured
    _store: TensorStore | None = field(default=None, repr=False)
    tower: str | None = None  # a multi-tower model (CLIP): the attribute of its text tower
    position_limit: int | None = None  # the most tokens its position embedding can number
    # Loaded with a weight memory limit: the limit, and the folder accelerate offloads to
    # (a TemporaryDirectory, removed with this object).
    max_memory: int | None = None
    offload: Any = field(default=None, repr=False)

    @property
    def offloaded(self) -> list[str]:
        """The modules whose weights live on disk between uses (accelerate's device map)."""
        device_map = getattr(self.model, "hf_device_map", None) or {}
        return [name for name, where in device_map.items() if where == "disk"]

    @property
    def encoder_decoder(self) -> bool:
        return bool(getattr(self.config, "is_encoder_decoder", False))

    @property
    def store(self) -> TensorStore:
        """attnviz's own view of the same files (for the proofs, which read attnviz's slices)."""
        if self._store is None:
            self._store = open_checkpoint(self.folder)
        return self._store

    @property
    def embeddings(self) -> torch.nn.Embedding:
        """The token embedding of the part that runs."""
        return token_embedding(self.model, self.tower, self.folder)

    @property
    def embedding_rows(self) -> int:
        return int(self.embeddings.num_embeddings)


def token_embedding(model: Any, tower: str | None, folder: Path) -> torch.nn.Embedding:
    """The token embedding of the part that runs (the text tower's, for multi-tower models)."""
    runner = getattr(model, tower) if tower is not None else model
    for owner in (runner, model):
        getter = getattr(owner, "get_input_embeddings", None)
        if getter is not None:
            with contextlib.suppress(NotImplementedError, AttributeError):
                found = getter()
                if isinstance(found, torch.nn.Embedding):
                    return found
    found = next((m for m in runner.modules() if isinstance(m, torch.nn.Embedding)), None)
    if found is None:
        raise CheckpointError("the model has no token embedding", where=str(folder))
    return found


def resolve_folder(spec: str) -> Path:
    """A model folder, or a hub id found in the local Hugging Face cache (never downloaded)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UsageError(f"{option('model')} takes a model folder or a hub id, not a file",
                         fix="pass the folder holding config.json", where=printable(spec))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UsageError("no such model folder", fix="check the path", where=printable(spec))
    require_transformers()
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec, "config.json")
    except ValueError:  # HFValidationError: not a valid repo id
        raise UsageError("not a model folder nor a valid hub id", fix=f"check {option('model')}",
                         where=printable(spec)) from None
    if not isinstance(found, str):
        raise CheckpointError(f"model {quoted(spec)} is not in the local Hugging Face cache",
                              fix=f"download it once with 'hf download {printable(spec)}' (attnviz "
                              "never downloads), or pass a model folder")
    return Path(found).parent


COMMON = {"local_files_only": True, "trust_remote_code": False}  # never repository code
FILES_FIX = "check that the folder holds config.json, the weights and the tokenizer files"


def load_model(spec: str, device: str = "cpu", dtype: str = "float32",
               device_map: str | None = None, tokenizer: Any = None) -> LoadedModel:
    """Model + tokenizer from a folder or the local hub cache, ready for `capture`.

    The model is loaded with eager attention, then switched to attnviz's attention function
    when its modeling file uses transformers' attention interface. `tokenizer` replaces the
    folder's own (the Python API; AutoTokenizer otherwise).
    """
    check_load_options(device, dtype, device_map)
    return load_weights(open_model(spec, tokenizer), device, dtype, device_map)


def check_load_options(device: str, dtype: str, device_map: str | None,
                       max_memory: int | None = None) -> None:
    """The loading options, checked before anything is read (`dtype` is a Dtype member,
    parsed where the request is built)."""
    require_transformers()
    if device_map is not None:
        if device_map != "auto":
            raise UsageError(f"unknown device map {device_map!r}", fix="use auto",
                             option="device_map")
        if importlib.util.find_spec("accelerate") is None:
            raise UsageError(f"{option('device_map')} auto needs accelerate",
                             fix="pip install accelerate")
    if max_memory is not None:
        if device_map is not None:
            raise UsageError(f"{option('max_memory')} places the weights itself",
                             fix=f"drop {option('device_map')}", option="device_map")
        if importlib.util.find_spec("accelerate") is None:
            raise UsageError(f"{option('max_memory')} offloads through accelerate, which is "
                             "not installed", fix=install_hint("offload"))
    if not device_map:
        resolve_device(device)


def open_model(spec: str, tokenizer: Any = None) -> OpenedModel:
    """The folder's headers, config.json and tokenizer, checked against each other; the model
    built on the meta device only (shapes, no memory) and compared with the checkpoint."""
    require_transformers()
    folder = resolve_folder(spec)
    where = printable_path(folder)
    store = open_checkpoint(folder)  # headers only
    guard.check_folder(folder, store)  # config.json and its layer counts: before transformers
    # config.json's fields read in attnviz's words (a list where a count belongs, 'yes' for a
    # flag) before transformers' own validation answers in its; the run does not use the result,
    # so a layout attnviz's tables read differently from the model (ConvBERT's head_ratio) is
    # no reason to refuse: the model computes its own maps.
    try:
        find_layers(store)
    except ConfigError:
        raise
    except LayoutError:
        pass
    import transformers

    readable = library_path(folder)  # a non-UTF-8 name: an ASCII link to the same folder
    with guard.silenced(stderr=True):  # transformers' reports and warnings are attnviz's to word
        with guard.contained("transformers cannot read the model's config.json", FILES_FIX,
                             where):
            config = transformers.AutoConfig.from_pretrained(readable, **COMMON)
            meta = guard.meta_model(transformers, config)  # shapes only, on the meta device
        tower = guard.text_runner(meta, config)
        if tokenizer is None:
            guard.check_tokenizer_files(folder)
        guard.check_sizes(meta, store, where)
        rows = int(token_embedding(meta, tower, folder).num_embeddings)
        limit = position_limit(meta, config)
        del meta
        if tokenizer is None:
            with guard.contained("the model's tokenizer cannot be loaded",
                                 "check or replace its tokenizer files", where):
                tokenizer = transformers.AutoTokenizer.from_pretrained(readable, **COMMON)
    return OpenedModel(folder, config, tokenizer, store, tower, rows, limit)


def position_limit(model: Any, config: Any) -> int | None:
    """The most tokens the model can number: config.json's max_position_embeddings, less the
    rows a learned position table reserves below its padding index (RoBERTa's positions start
    at padding_idx + 1, so 514 rows number 512 tokens). Read from the model's own modules (on
    the meta device), not from a list of families."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        return None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and "position" in name.rsplit(".", 1)[-1] \
                and module.num_embeddings == positions and module.padding_idx is not None:
            return max(1, positions - module.padding_idx - 1)
    return positions


def load_weights(opened: OpenedModel, device: str = "cpu", dtype: str = "float32",
                 device_map: str | None = None, max_memory: int | None = None) -> LoadedModel:
    """The weights of an opened model, with eager attention (the one that returns weights), on
    its device; switched to attnviz's attention function where the modeling file allows.

    max_memory: bytes of weights kept on the device (and as many in CPU memory); accelerate
    offloads the rest to a temporary folder and loads each module as the forward reaches it."""
    check_load_options(device, dtype, device_map, max_memory)
    import transformers

    folder, where = opened.folder, printable_path(opened.folder)
    dtype_key = dtype_keyword()
    placement, offload = _placement(device, device_map, max_memory)
    try:
        with guard.silenced(stderr=True), \
                guard.contained("transformers cannot load the model", FILES_FIX, where):
            model, info = transformers.AutoModel.from_pretrained(
                library_path(folder), attn_implementation="eager", output_loading_info=True,
                **{dtype_key: dtype if dtype == "auto" else getattr(torch, dtype)}, **placement,
                **COMMON)
    except CheckpointError as error:
        if max_memory is None or "whole model to the disk" not in error.what:
            raise
        # older accelerate releases refuse to offload every module
        raise UsageError(f"{option('max_memory')} {max_memory} bytes holds none of the model's "
                         "modules", fix="give more memory (at least the token embedding's "
                         "size), or upgrade accelerate", option="max_memory") from None
    model.eval()
    if not placement:
        model.to(resolve_device(device))
    dtype = str(model.dtype).removeprefix("torch.")  # "auto" resolved
    if dtype not in TOLERANCE:
        raise CheckpointError(f"the checkpoint's weights are {dtype}, which attnviz does not "
                              "compare maps in", fix=f"pass {option('dtype')} float32", where=where)
    runner = getattr(model, opened.tower) if opened.tower is not None else model
    runner_params = {id(p) for p in runner.parameters()}
    computed = guard.computed_tables(model)
    guard.check_loaded(info, {name for name, p in model.named_parameters()
                              if id(p) in runner_params and name not in computed}, where)
    return LoadedModel(model, opened.tokenizer, folder, opened.config, dtype,
                       capture_path(model), _store=opened.store, tower=opened.tower,
                       position_limit=opened.position_limit, max_memory=max_memory,
                       offload=offload)


def _placement(device: str, device_map: str | None,
               max_memory: int | None) -> tuple[dict[str, Any], Any]:
    """from_pretrained's placement keywords, and the offload folder they name (or None)."""
    if max_memory is None:
        return ({"device_map": device_map} if device_map else {}), None
    import tempfile

    target = resolve_device(device)
    limits: dict[int | str, int] = {"cpu": max_memory}
    if target.type == "cuda":
        limits[target.index or 0] = max_memory
    offload = tempfile.TemporaryDirectory(prefix="attnviz-offload-")
    return {"device_map": "auto", "max_memory": limits, "offload_folder": offload.name}, offload


def capture_path(model: Any) -> capture.CapturePath:
    """Register attnviz's attention function, and route `model` through it where its attention
    modules use transformers' interface; else its maps come from output_attentions."""
    capture.register()
    if capture.uses_interface(model):
        model.set_attn_implementation(capture.NAME)
        return capture.CapturePath.INTERFACE
    return capture.CapturePath.OUTPUT_ATTENTIONS


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def dtype_keyword() -> str:
    """from_pretrained's keyword for the dtype: `dtype`, `torch_dtype` before transformers 5."""
    return "dtype" if transformers_major() >= 5 else "torch_dtype"


def input_device(model: Any) -> torch.device:
    """Where the inputs go: the token embedding's device (under --device-map, the first)."""
    import contextlib

    with contextlib.suppress(NotImplementedError, AttributeError):
        embedding = model.get_input_embeddings()
        device = embedding.weight.device
        if device.type == "meta":  # offloaded: accelerate's hook moves it where it runs
            hook = getattr(embedding, "_hf_hook", None)
            return torch.device(getattr(hook, "execution_device", None) or "cpu")
        return device
    return next(model.parameters()).device


