"""Find a checkpoint's attention modules by building its model from config.json on the meta device.

For checkpoints whose tensor names match no row of `attnviz.recognize.conventions`, transformers
itself knows the module tree: `AutoModel.from_config(config)` under `torch.device("meta")`
allocates no memory and reads no weights; no remote code runs (trust_remote_code=False, and a
config naming its own code is refused by transformers). Each outermost module whose class name
says Attention is reported as `ModuleFacts` (name, class, parameter names and shapes, the head
counts its attributes hold); `attnviz.recognize.discovered` matches them to the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from attnviz.errors import printable
from attnviz.load.config import model_type
from attnviz.load.store import TensorStore
from attnviz.recognize.discovered import ModuleFacts, Param

HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads")
DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_head", "key_value_proj_dim",
             "d_kv")
MAX_MODULES = 100_000


def discover_modules(store: TensorStore) -> list[ModuleFacts] | str:
    """The attention modules of the model config.json describes, or why it cannot be built."""
    kind = model_type(store.config)
    if kind is None:
        return "config.json names no model_type"
    try:
        import torch
        import transformers
    except ImportError:
        return "transformers is not installed"
    # here, not at the top: importing attnviz.sources.hf imports torch, and a checkpoint the
    # naming tables recognize is inspected without it (discovery is imported for every one)
    from attnviz.sources.hf.guard import silenced

    fields = {k: v for k, v in store.config.items() if k != "model_type"}
    try:
        with silenced():
            config = transformers.AutoConfig.for_model(kind, **fields)
            with torch.device("meta"):
                model = transformers.AutoModel.from_config(config, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - any failure of a foreign config means "cannot"
        return f"transformers cannot build model_type {printable(kind)!r}: " \
               f"{printable(str(error), 160)}"
    return module_facts(model)


def module_facts(model: Any) -> list[ModuleFacts]:
    """Every outermost attention module of `model` (a torch module tree), as facts."""
    found: list[ModuleFacts] = []
    taken: list[str] = []
    for count, (name, module) in enumerate(model.named_modules()):
        if count > MAX_MODULES:
            break
        if not name or not _is_attention(module):
            continue
        if any(name.startswith(outer + ".") for outer in taken):
            continue
        params = tuple(_params(module))
        if not params:
            continue
        taken.append(name)
        inner = list(module.modules())
        found.append(ModuleFacts(
            name, type(module).__name__, params,
            num_heads=_attribute(inner, HEAD_ATTRS, "num_attention_heads"),
            num_kv_heads=_attribute(inner, KV_ATTRS, "num_key_value_heads"),
            head_dim=_attribute(inner, DIM_ATTRS, "head_dim")))
    return found


def _is_attention(module: Any) -> bool:
    from transformers import PreTrainedModel

    return "Attention" in type(module).__name__ and not isinstance(module, PreTrainedModel)


def _params(module: Any) -> Iterator[Param]:
    owners = dict(module.named_modules())
    for name, param in module.named_parameters():
        owner = owners.get(name.rpartition(".")[0])
        conv1d = owner is not None and type(owner).__name__ == "Conv1D"
        yield Param(name, tuple(param.shape), conv1d and param.ndim == 2)


def _attribute(modules: list[Any], names: tuple[str, ...], config_name: str) -> int | None:
    """The first positive integer attribute of these modules (then of their config) named so."""
    for module in modules:
        for name in names:
            value = getattr(module, name, None)
            if type(value) is int and value > 0:
                return value
    for module in modules:
        value = getattr(getattr(module, "config", None), config_name, None)
        if type(value) is int and value > 0:
            return value
    return None
