"""Recognition: tensors + config.json → AttentionLayer descriptions, driven by two tables.

`conventions.CONVENTIONS` lists naming conventions and storage schemes (which tensor is W_q, how a
fused tensor stacks its rows), `model_type_table.MODEL_TYPES` what each model_type's attention does.
Rows are tried in order; a tensor claimed by one row is never offered to a later one. Tensors that
look like attention but match no row can be resolved by a `Discover` hook (sources/discover.py
builds the model from config.json on the meta device); what stays unmatched is listed, never
dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import attnviz.recognize.conventions as conventions
import attnviz.recognize.discovered as discovered
import attnviz.recognize.match as match
from attnviz.core.layer import AttentionLayer
from attnviz.core.request import HeadHints
from attnviz.errors import AttnvizError, CheckpointError, UsageError, option, printable, quoted
from attnviz.load.store import TensorStore
from attnviz.recognize.base import Unresolved, natural_key
from attnviz.recognize.discovered import Discover
from attnviz.recognize.model_types import check_config

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


def find_layers(store: TensorStore, hints: HeadHints | None = None,
                discover: Discover | None = None) -> Inventory:
    """Recognize every attention layer in `store` (reads headers only).

    discover: called only when config.json names a model_type and some attention-looking
    tensors match no row (or a layer's head count is missing): it builds the model to find its
    attention modules; see `attnviz.sources.discover`.
    """
    hints = hints or HeadHints()
    check_config(store.config)
    layers: list[AttentionLayer] = []
    pending: list[Unresolved] = []
    claimed: set[str] = set()
    for row in conventions.CONVENTIONS:  # read at call time: a row added later counts
        for prefix in match.candidates(store, row):
            keys = match.keys_of(store, row, prefix)
            if keys & claimed:
                continue
            found = match.build(store, row, prefix, hints)
            if found is None:
                continue
            if isinstance(found, Unresolved):
                pending.append(found)
            else:
                layers.append(found)
            claimed |= keys
    inventory = _inventory(store, layers, pending, claimed)
    if discover is not None and discovered.wanted(store, inventory.layers,
                                                  inventory.unclassified):
        layers, pending, claimed = discovered.resolve(store, inventory.layers,
                                                      inventory.unresolved, hints, discover,
                                                      claimed)
        inventory = _inventory(store, layers, pending, claimed)
    return inventory


def _inventory(store: TensorStore, layers: list[AttentionLayer], pending: list[Unresolved],
               claimed: set[str]) -> Inventory:
    layers = sorted(layers, key=lambda layer: natural_key(layer.name))
    pending = sorted(pending, key=lambda item: natural_key(item.name))
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


def _unusable(item: Unresolved, source: str) -> AttnvizError:
    """The error for asking for an unresolved layer: bad data when its tensors are the problem
    (a dtype), misuse otherwise (a head count the caller must give)."""
    kind = CheckpointError if item.data else UsageError
    return kind(item.what, fix=item.fix, where=source)


def select_layer(inventory: Inventory, spec: str | None, source: str) -> AttentionLayer:
    """A layer by index (0, -1) or by name; the only layer when `spec` is None."""
    layers = inventory.layers
    if not layers and inventory.unresolved:
        raise _unusable(inventory.unresolved[0], source)
    if not layers:
        raise UsageError("no attention layer recognized", fix="run 'attnviz inspect' on it to see "
                         "what it holds", where=source)
    if spec is None:
        if len(layers) > 1:
            raise UsageError(f"the checkpoint has {len(layers)} attention layers",
                             fix=f"choose one with {option('layer')} INDEX or "
                                 f"{option('layer')} NAME "
                             "(see 'attnviz inspect')", where=source)
        return layers[0]
    if re.fullmatch(r"-?[0-9]+", spec):
        index = int(spec) if len(spec) <= 19 else len(layers)  # 5000 digits: past int()
        if not -len(layers) <= index < len(layers):
            raise UsageError(f"layer index {printable(spec, 24)} is out of range",
                             fix=f"choose 0..{len(layers) - 1}", where=source)
        return layers[index]
    for layer in layers:
        if layer.name == spec or layer.name == spec.rstrip("."):
            return layer
    for item in inventory.unresolved:
        if item.name == spec.rstrip("."):
            raise _unusable(item, source)
    raise UsageError(f"no attention layer named {quoted(spec)}",
                     fix="see 'attnviz inspect' for the names", where=source)
