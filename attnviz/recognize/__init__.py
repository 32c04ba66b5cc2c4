"""The registry of layout families: each recognizes its key names and builds AttentionLayers.

Adding a family is one module with `FAMILY` and `find(store, hints)`, plus one entry below.
Families are tried in order; a key claimed by an earlier family is not offered to later ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from attnviz.core.layer import AttentionLayer
from attnviz.errors import UsageError, quoted
from attnviz.load.checkpoint import TensorStore
from attnviz.recognize import bert, fused_qkv, gpt2, gpt_bigcode, neox, qkv_proj, t5, torch_mha
from attnviz.recognize.base import HeadHints, Unresolved, natural_key

Finder = Callable[[TensorStore, HeadHints], list[AttentionLayer | Unresolved]]

FAMILIES: dict[str, Finder] = {}


def register(module: ModuleType) -> None:
    FAMILIES[module.FAMILY] = module.find


for _module in (torch_mha, bert, gpt2, gpt_bigcode, qkv_proj, fused_qkv, neox, t5):
    register(_module)

# Key fragments that mark a tensor as attention-related; unclaimed ones are reported, not dropped.
_ATTENTION_HINT = re.compile(r"(attn|attention|self_attention|selfattention|encdecattention)",
                             re.IGNORECASE)
_NOT_WEIGHTS = re.compile(r"(inv_freq|masked_bias|norm|rotary|relative_attention_bias|ln_attn|"
                          r"distance_embedding|relative_position)", re.IGNORECASE)


@dataclass(frozen=True)
class Inventory:
    """Everything recognized in one checkpoint."""

    layers: list[AttentionLayer]
    unclassified: list[str]  # prefixes of attention-looking tensors no family claimed
    unresolved: list[Unresolved] = field(default_factory=list)  # recognized, heads not located


def claimed_keys(layer: AttentionLayer) -> set[str]:
    refs = (layer.q_weight, layer.k_weight, layer.v_weight, layer.o_weight, layer.q_bias,
            layer.k_bias, layer.v_bias, layer.o_bias, layer.bias_k, layer.bias_v)
    return {r.key for r in refs if r is not None}


def find_layers(store: TensorStore, hints: HeadHints | None = None) -> Inventory:
    """Recognize every attention layer in `store` (reads headers only)."""
    hints = hints or HeadHints()
    layers: list[AttentionLayer] = []
    pending: list[Unresolved] = []
    claimed: set[str] = set()
    for finder in FAMILIES.values():
        for found in finder(store, hints):
            keys = set(found.keys) if isinstance(found, Unresolved) else claimed_keys(found)
            if keys & claimed:
                continue
            if isinstance(found, Unresolved):
                pending.append(found)
            else:
                layers.append(found)
            claimed |= keys
    layers.sort(key=lambda layer: natural_key(layer.name))
    pending.sort(key=lambda item: natural_key(item.name))
    names = [layer.name for layer in layers] + [item.name for item in pending]
    return Inventory(layers, _unclassified(store, claimed, names), pending)


def _unclassified(store: TensorStore, claimed: set[str], layer_names: list[str]) -> list[str]:
    names = set(layer_names)
    groups = set()
    for key in store.keys():
        if key in claimed or not _ATTENTION_HINT.search(key) or _NOT_WEIGHTS.search(key):
            continue
        if key.endswith(".bias") and key.rsplit(".", 1)[0] in names:
            continue  # e.g. GPT-2's attn.bias, a causal-mask buffer beside a recognized layer
        match = _ATTENTION_HINT.search(key)
        end = key.find(".", match.end()) if match else -1
        groups.add(key if end < 0 else key[:end])
    return sorted(groups, key=natural_key)


def select_layer(inventory: Inventory, spec: str | None, source: str) -> AttentionLayer:
    """A layer by index (0, -1) or by name; the only layer when `spec` is None."""
    layers = inventory.layers
    if not layers and inventory.unresolved:
        raise UsageError(inventory.unresolved[0].what, inventory.unresolved[0].fix, source)
    if not layers:
        raise UsageError("no attention layer recognized", "run 'attnviz inspect' on it to see "
                         "what it holds", source)
    if spec is None:
        if len(layers) > 1:
            raise UsageError(f"the checkpoint has {len(layers)} attention layers",
                             "choose one with --layer INDEX or --layer NAME "
                             "(see 'attnviz inspect')", source)
        return layers[0]
    if re.fullmatch(r"-?\d+", spec):
        index = int(spec)
        if not -len(layers) <= index < len(layers):
            raise UsageError(f"layer index {index} is out of range",
                             f"choose 0..{len(layers) - 1}", source)
        return layers[index]
    for layer in layers:
        if layer.name == spec or layer.name == spec.rstrip("."):
            return layer
    for item in inventory.unresolved:
        if item.name == spec.rstrip("."):
            raise UsageError(item.what, item.fix, source)
    raise UsageError(f"no attention layer named {quoted(spec)}",
                     "see 'attnviz inspect' for the names", source)
