"""Attention modules found by building the model, for checkpoints whose names match no row.

`attnviz.sources.discover` builds the model from config.json on the meta device (it needs torch
and transformers, which this layer never imports) and reports each attention module as
`ModuleFacts`: its name, class, parameters and the head counts its attributes hold. Here those
facts are matched to the checkpoint: a layer whose head count config.json did not give (Swin's
per-stage list) takes the module's; an attention module no convention claimed becomes a layer
when its q, k, v and o projections can be told apart by name without doubt, and is listed as
unresolved, with the reason, when they cannot. Nothing is guessed from shapes.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import attnviz.recognize.match as match
import attnviz.recognize.model_type_table as model_type_table
import attnviz.recognize.model_types as model_types
from attnviz.core.layer import AttentionLayer
from attnviz.core.request import HeadHints
from attnviz.errors import LayoutError, printable
from attnviz.load.config import model_type, tower_config
from attnviz.load.store import TensorStore
from attnviz.recognize.base import Unresolved, finish, optional_ref, ref


@dataclass(frozen=True)
class Param:
    name: str  # relative to the module, e.g. "self.query.weight"
    shape: tuple[int, ...]
    transposed: bool = False  # held by a Conv1D: stored (in, out)


@dataclass(frozen=True)
class ModuleFacts:
    """One attention module of the built model (no tensor data)."""

    name: str  # in model.named_modules(), e.g. "h.0.multi_head_attention"
    cls: str  # its class name
    params: tuple[Param, ...]
    num_heads: int | None = None  # what its attributes (or its config) say
    num_kv_heads: int | None = None
    head_dim: int | None = None


# What discovery returns: the modules, or why the model could not be built.
Discover = Callable[[TensorStore], "list[ModuleFacts] | str"]

# Words in a projection's name that say which part it is. A name matching two parts, or two names
# matching one part, leave the module unresolved.
PART_WORDS = {"q": {"q", "query", "wq", "queries"}, "k": {"k", "key", "wk", "keys"},
              "v": {"v", "value", "wv", "values"}}
OUT_WORDS = {"o", "out", "output", "wo", "dense", "proj", "c_proj"}
FUSED_WORDS = {"qkv", "wqkv", "query_key_value", "c_attn", "in_proj", "kv", "key_value"}
NORM_WORDS = {"norm", "layernorm", "ln", "layer_norm", "rmsnorm"}
NAMING_FIX = ("if its tensor names say which is W_q, W_k, W_v and W_o, add a naming row for "
              "them to attnviz/recognize/conventions.py")
BUILT = "found by building the model from config.json on the meta device"


def wanted(store: TensorStore, layers: list[AttentionLayer], unclassified: list[str]) -> bool:
    """Whether building the model could add anything: config.json names a model_type and some
    attention tensors are unclaimed, or a layer read with config.json lacks its head count."""
    if model_type(store.config) is None:
        return False
    return bool(unclassified) or any(not layer.heads_known and layer.family not in
                                     ("torch-mha", "timm") for layer in layers)


def resolve(store: TensorStore, layers: list[AttentionLayer], pending: list[Unresolved],
            hints: HeadHints, discover: Discover,
            claimed: set[str]) -> tuple[list[AttentionLayer], list[Unresolved], set[str]]:
    """Layers and unresolved modules after matching the built model's attention modules."""
    facts = discover(store)
    if isinstance(facts, str):
        return layers, pending, claimed
    keys = sorted(store.keys())
    placed = _place(keys, facts)
    layers = [_with_module_heads(layer, placed, store) for layer in layers]
    claimed = set(claimed)
    pending = list(pending)
    for prefix, fact in placed:
        held = _under(keys, prefix)
        if not held or set(held) & claimed:
            continue
        params = _checkpoint_params(store, prefix, held, fact)
        if not any(_looks_projected(param) for param in params):
            continue
        found = _build(store, prefix, replace(fact, params=params), hints)
        if isinstance(found, Unresolved):
            pending.append(found)
        else:
            layers.append(found)
        claimed |= set(held)
    return layers, pending, claimed


def _under(keys: list[str], prefix: str) -> list[str]:
    """The sorted `keys` that start with `prefix`."""
    start = bisect.bisect_left(keys, prefix)
    stop = start
    while stop < len(keys) and keys[stop].startswith(prefix):
        stop += 1
    return keys[start:stop]


def _place(keys: list[str], facts: list[ModuleFacts]) -> list[tuple[str, ModuleFacts]]:
    """(checkpoint prefix, facts) per module found in the checkpoint. Task checkpoints put the
    base model under a prefix (`bert.`); transformers may rename parameters when it saves, so
    only module names are matched, not parameter names."""
    outers: list[str] = []
    for fact in facts[:8]:
        needle = fact.name + "."
        outers = sorted({key[: key.find(needle)] for key in keys
                         if needle in key and (key.startswith(needle) or
                                               key[key.find(needle) - 1] == ".")}, key=len)
        if outers:
            break
    placed = []
    for fact in facts:
        for outer in outers[:4]:
            if _under(keys, f"{outer}{fact.name}."):
                placed.append((f"{outer}{fact.name}.", fact))
                break
    return placed


def _checkpoint_params(store: TensorStore, prefix: str, held: list[str],
                       fact: ModuleFacts) -> tuple[Param, ...]:
    """The module's tensors as the checkpoint names and shapes them (Conv1D from the model)."""
    conv1d = {param.name for param in fact.params if param.transposed}
    return tuple(Param(key[len(prefix):], store.info(key).shape, key[len(prefix):] in conv1d)
                 for key in held)


def _with_module_heads(layer: AttentionLayer, placed: list[tuple[str, ModuleFacts]],
                       store: TensorStore) -> AttentionLayer:
    """A layer without a head count takes the one its module (or a module inside it) holds."""
    if layer.heads_known:
        return layer
    prefix = layer.name + "."
    for module_prefix, fact in placed:
        inside = module_prefix.startswith(prefix) or prefix.startswith(module_prefix)
        if inside and fact.num_heads is not None:
            with_heads = finish(layer, HeadHints(fact.num_heads, fact.num_kv_heads,
                                                 fact.head_dim), store.source)
            return replace(with_heads, notes=(*layer.notes, f"head counts from {fact.cls} "
                                              f"({BUILT})"))
    return layer


def _looks_projected(param: Param) -> bool:
    """A parameter named like a projection: not a bias, not a norm, not 1-D."""
    words = _words(param.name)
    if param.name.endswith("bias") or len(param.shape) == 1 or words & NORM_WORDS:
        return False
    return _part(param.name) is not None


def _words(name: str) -> set[str]:
    stem = re.sub(r"[._]?weight$", "", name)
    words = set(re.split(r"[._]", stem.lower()))
    words.add(stem.lower().rsplit(".", 1)[-1])
    return words


def _part(name: str) -> str | None:
    """q, k, v, o or "fused" for a projection's name; None if the name says none of them."""
    words = _words(name)
    if words & FUSED_WORDS:
        return "fused"
    parts = [part for part, vocabulary in PART_WORDS.items() if words & vocabulary]
    if len(parts) == 1:
        return parts[0]
    if not parts and words & OUT_WORDS:
        return "o"
    return "ambiguous" if parts else None


def _projection_problem(by_part: dict[str, list[Param]],
                        projections: list[Param]) -> tuple[str, str] | None:
    """(reason, fix) when the projections are not one 2-D W_q, W_k, W_v and W_o told apart by
    name; None when they are."""
    listed = ", ".join(f"{p.name} {tuple(p.shape)}" for p in projections[:8])
    if "fused" in by_part:
        return (f"{by_part['fused'][0].name} fuses projections whose row layout attnviz does "
                f"not know ({BUILT})", "report the model to attnviz")
    if any(len(p.shape) != 2 or not p.name.endswith("weight") for p in projections):
        return (f"its projections are not 2-D nn.Linear weights ({listed})",
                "attnviz splits (out, in) projection matrices only; this module's layout needs "
                "its own code")
    if any(len(by_part.get(part, [])) != 1 for part in "qkvo") or "ambiguous" in by_part:
        return ("attnviz cannot tell which tensors are W_q, W_k, W_v and W_o by name "
                f"({listed})", NAMING_FIX)
    return None


def _build(store: TensorStore, prefix: str, fact: ModuleFacts,
           hints: HeadHints) -> AttentionLayer | Unresolved:
    name = prefix.rstrip(".")
    kind, tower = model_types.base_type(model_type(store.config))
    entry = model_types.lookup(kind)
    family = model_types.family_of(kind) if entry is not None and kind is not None \
        else kind or "unknown"
    keys = tuple(sorted(prefix + p.name for p in fact.params if prefix + p.name in store))
    projections = [p for p in fact.params if _looks_projected(p)]

    def unresolved(reason: str, fix: str = NAMING_FIX) -> Unresolved:
        return Unresolved(name, family, keys, f"{fact.cls}: {reason}", fix)

    by_part: dict[str, list[Param]] = {}
    for param in projections:
        by_part.setdefault(_part(param.name) or "", []).append(param)
    problem = _projection_problem(by_part, projections)
    if problem is not None:
        return unresolved(*problem)
    refs = {part: ref(store, prefix + by_part[part][0].name,
                      transposed=by_part[part][0].transposed) for part in "qkvo"}
    biases = {part: optional_ref(store, prefix + by_part[part][0].name.removesuffix("weight")
                                 + "bias") for part in "qkvo"}
    config = tower_config(store.config, prefix)[1]
    role = match.role_of(prefix)
    found = model_types.config_heads(entry or model_type_table.GENERIC, config, role)
    heads = HeadHints(hints.num_heads or fact.num_heads or found.num_heads,
                      hints.num_kv_heads or fact.num_kv_heads or found.num_kv_heads,
                      hints.head_dim or fact.head_dim or found.head_dim)
    names = "/".join(by_part[p][0].name.removesuffix(".weight") for p in "qkv")
    layer = AttentionLayer(
        name=name, family=family, embed_dim=refs["q"].shape[1], kdim=refs["k"].shape[1],
        vdim=refs["v"].shape[1], num_heads=None, num_kv_heads=None, head_dim=None,
        q_weight=refs["q"], k_weight=refs["k"], v_weight=refs["v"], o_weight=refs["o"],
        q_bias=biases["q"], k_bias=biases["k"], v_bias=biases["v"], o_bias=biases["o"],
        storage=f"separate {names} + {by_part['o'][0].name.removesuffix('.weight')} in "
        f"{fact.cls}, {BUILT}",
    )
    try:
        layer = finish(layer, heads, store.source)
    except LayoutError as error:
        return unresolved(f"its head counts do not fit its weights: {error.what}")
    notes = [] if entry is not None else [
        f"model_type {printable(kind or '')!r} is not known to attnviz: positions, causal "
        "masking and scale are shown as none, not causal, 1/√d"]
    ctx = match.Context(prefix, config, kind, tower, entry or model_type_table.GENERIC, family,
                        role, ())
    return match.describe(layer, store, ctx, None, tuple(notes))
