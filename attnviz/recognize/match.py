"""Applying one naming convention at one prefix: tensors + config.json → an AttentionLayer, or an
`Unresolved` entry that says what is missing. Everything family-specific comes from the two tables
(`conventions.CONVENTIONS`, `model_type_table.MODEL_TYPES`); this module only reads them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import attnviz.recognize.model_type_table as model_type_table
import attnviz.recognize.model_types as model_types
from attnviz.core.layer import AttentionLayer, check_self_widths
from attnviz.core.request import HeadHints
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import DtypeError, HeadCountError, LayoutError, printable
from attnviz.load.config import model_type, tower_config
from attnviz.load.store import TensorStore
from attnviz.recognize.base import (
    Unresolved,
    finish,
    layer_index,
    metadata_int,
    optional_ref,
    prefixes_with,
    ref,
)
from attnviz.recognize.conventions import Convention
from attnviz.recognize.parts import Splitter, bias_parts, packed_heads, weight_parts

NEEDS_TYPE = "open the model folder with its config.json (model_type says which)"
NEEDS_HEADS = "pass --num-heads, or open the model folder with its config.json"
CROSS_MODULES = ("encoder_attn", "cross_attn", "crossattention", "cross_attention",
                 "EncDecAttention")
RELATIVE_KEYS = ("distance_embedding.weight", "relative_position_bias_table",
                 "relative_attention_bias.weight")
RELATIVE_TYPES = ("relative_key", "relative_key_query")  # BERT's position_embedding_type
NORMS = (("q_norm.weight", "k_norm"), ("q_layernorm.weight", "k_layernorm"))


@dataclass(frozen=True)
class Context:
    """What config.json says about the layer at one prefix."""

    prefix: str
    config: dict[str, Any]  # the layer's own (tower) config, {} when the format has none
    kind: str | None  # model_type, tower suffix removed
    tower: str | None
    # the model_type's row, the one the convention assumes, or GENERIC
    entry: model_type_table.ModelType
    family: str
    role: str  # encoder, decoder, cross or self
    notes: tuple[str, ...]  # about how the facts were chosen

    @property
    def index(self) -> int | None:
        return layer_index(self.prefix)


def module_name(prefix: str) -> str:
    return prefix.rstrip(".").rsplit(".", 1)[-1]


def role_of(prefix: str) -> str:
    """encoder, decoder, cross (attention over the encoder's output) or self."""
    parts = prefix.rstrip(".").split(".")
    if parts[-1] in CROSS_MODULES:
        return "cross"
    return next((p for p in reversed(parts) if p in ("encoder", "decoder")), "self")


def context(store: TensorStore, row: Convention, prefix: str) -> Context | None:
    """The model-type facts for `row` at `prefix`; None when the row does not apply there."""
    tower, config = tower_config(store.config, prefix) if row.config else (None, {})
    kind, tower = model_types.base_type(model_type(config) or model_type(store.config),
                               tower) if row.config else (None, None)
    if (row.only and kind not in row.only) or kind in row.never:
        return None
    entry, notes = model_types.lookup(kind), []
    family = model_types.family_of(kind) if entry is not None and kind is not None else row.label
    if entry is None:
        entry = model_type_table.MODEL_TYPES[row.assume] if row.assume else model_type_table.GENERIC
        if row.config and row.packing is None and kind is None and row.assume:
            notes.append(f"no config.json: {family} layout assumed from the key names")
        elif row.config and row.assume is None and kind is None:
            notes.append("no config.json model_type: positions, causal masking and scale are "
                         "not known, shown as none, not causal, 1/√d")
        elif row.config and row.assume is None:
            notes.append(f"model_type {printable(kind or '')!r} is not known to attnviz: "
                         "positions, causal masking and scale are shown as none, not causal, 1/√d")
    return Context(prefix, config, kind, tower, entry, family, role_of(prefix), tuple(notes))


def candidates(store: TensorStore, row: Convention) -> list[str]:
    """Prefixes where every weight of `row` and one of its W_o names are present."""
    found = []
    for prefix in prefixes_with(store.keys(), row.parts_key):
        if row.module and module_name(prefix) not in row.module:
            continue
        if all(prefix + name in store for name, _ in row.weights) and out_name(store, row, prefix):
            found.append(prefix)
    return found


def out_name(store: TensorStore, row: Convention, prefix: str) -> str | None:
    return next((name for name in row.out if prefix + name in store), None)


def keys_of(store: TensorStore, row: Convention, prefix: str) -> set[str]:
    """The tensors `row` claims at `prefix` (weights, present biases, W_o and its bias)."""
    names = [name for name, _ in row.weights] + [name for name, _ in row.bias_parts()]
    o_name = out_name(store, row, prefix)
    if o_name is not None:
        names += [o_name, o_name.removesuffix("weight") + "bias"]
    names += [name for name, _ in row.extras] + list(row.also)
    return {prefix + name for name in names if prefix + name in store}


def head_hints(store: TensorStore, row: Convention, ctx: Context,
               hints: HeadHints) -> tuple[HeadHints, tuple[str, ...]]:
    """Head counts by precedence: command line, then config.json, then safetensors metadata."""
    found = model_types.config_heads(ctx.entry, ctx.config, ctx.role) if row.config \
        else model_types.Heads()
    return HeadHints(
        hints.num_heads or found.num_heads or metadata_int(store, "num_heads"),
        hints.num_kv_heads or found.num_kv_heads or metadata_int(store, "num_kv_heads"),
        hints.head_dim or found.head_dim or metadata_int(store, "head_dim"),
    ), found.notes


def build(store: TensorStore, row: Convention, prefix: str,
          hints: HeadHints) -> AttentionLayer | Unresolved | None:
    """The layer `row` describes at `prefix`; None where the row does not apply (model_type).
    Head counts the caller gave that do not fit the weights are misuse, not bad data."""
    try:
        return _build(store, row, prefix, hints)
    except DtypeError as error:  # this layer cannot be used; the file's others can
        return Unresolved(prefix.removesuffix("."), row.label,
                          tuple(sorted(keys_of(store, row, prefix))), error.what,
                          "attnviz computes with floating-point attention weights only", True)
    except HeadCountError as error:
        given = next((name for name in ("num_heads", "head_dim", "num_kv_heads")
                      if getattr(hints, name) is not None), None)
        if given is None:
            raise
        raise error.as_usage(given) from None


def _build(store: TensorStore, row: Convention, prefix: str,
           hints: HeadHints) -> AttentionLayer | Unresolved | None:
    ctx = context(store, row, prefix)
    if ctx is None:
        return None
    heads, count_notes = head_hints(store, row, ctx, hints)
    o_name = out_name(store, row, prefix)
    assert o_name is not None  # candidates() checked it
    weights = {name: ref(store, prefix + name, transposed=row.conv1d) for name, _ in row.weights}
    o_weight = ref(store, prefix + o_name, transposed=row.conv1d)
    fused = [name for name, held in row.weights if len(held) > 1]
    packing = ctx.entry.packing_for(ctx.config) or row.packing
    shape_heads: tuple[int, int, int] | None = None
    storage = row.storage.replace("{out}", o_name.removesuffix(".weight")).replace(
        "{module}", module_name(prefix))
    if fused:
        resolved = _fused_heads(store, row, ctx, packing, (heads, hints), o_weight)
        if isinstance(resolved, Unresolved):
            return resolved
        heads, shape_heads, described = resolved
        storage = storage or described
    split = Splitter(packing, shape_heads, storage, row, store.source)
    parts = weight_parts(weights, row, split)
    biases = bias_parts(store, row, prefix, split)
    extras = {name: optional_ref(store, prefix + key, flatten=True) for key, name in row.extras}
    q, k, v = parts["q"], parts["k"], parts["v"]
    layer = AttentionLayer(
        name=prefix.rstrip("."), family=ctx.family, embed_dim=q.shape[1], kdim=k.shape[1],
        vdim=v.shape[1], num_heads=None, num_kv_heads=None, head_dim=None, q_weight=q,
        k_weight=k, v_weight=v, o_weight=o_weight, q_bias=biases.get("q"),
        k_bias=biases.get("k"), v_bias=biases.get("v"),
        o_bias=optional_ref(store, prefix + o_name.removesuffix("weight") + "bias"),
        bias_k=extras.get("bias_k"), bias_v=extras.get("bias_v"), storage=storage,
    )
    if _reads_own_stream(row, prefix):
        try:
            check_self_widths(layer)
        except LayoutError as error:
            error.where = error.where or store.source
            raise
    layer = finish(layer, heads, store.source)
    return describe(layer, store, ctx, row, (*ctx.notes, *count_notes))


def _reads_own_stream(row: Convention, prefix: str) -> bool:
    """Self-attention whose keys and values must be as wide as its queries: not a module under
    a cross-attention name, not nn.MultiheadAttention (whose kdim/vdim may differ)."""
    parts = prefix.rstrip(".").split(".")
    return row.assume != "torch-mha" and not any(p in CROSS_MODULES for p in parts)


def _fused_heads(store: TensorStore, row: Convention, ctx: Context,
                 packing: model_type_table.Packing | None, counts: tuple[HeadHints, HeadHints],
                 o_weight: TensorRef
                 ) -> tuple[HeadHints, tuple[int, int, int] | None, str] | Unresolved:
    """For the row's first tensor that fuses q, k and v: (head hints, the head counts its
    packing needs or None, how it is stored), or why its rows cannot be told apart. counts:
    (the head hints found so far, the command line's)."""
    heads, hints = counts
    prefix = ctx.prefix
    name = next(key for key, held in row.weights if len(held) > 1).removesuffix(".weight")
    if packing is None:
        return _unresolved(store, row, prefix, ctx.family, row.ambiguous or (
            f"{name} fuses q, k and v, and attnviz does not know how model_type "
            f"{printable(ctx.kind or '')!r} lays out its rows"),
            NEEDS_TYPE if ctx.kind is None else "report the model to attnviz")
    shape_heads = None
    if packing.needs_heads:
        if heads.num_heads is None:
            per_head = " per head" if packing.groups == "heads" else ""
            return _unresolved(store, row, prefix, ctx.family,
                               f"{name} fuses q, k and v{per_head}: which rows are W_q "
                               "depends on the number of heads", NEEDS_HEADS)
        shape_heads = packed_heads(heads, hints, packing, o_weight, store.source)
        heads = HeadHints(*shape_heads)
    return heads, shape_heads, packing.describe.replace("{name}", name)


def _unresolved(store: TensorStore, row: Convention, prefix: str, family: str, reason: str,
                fix: str) -> Unresolved:
    keys = tuple(sorted(keys_of(store, row, prefix)))
    return Unresolved(prefix.rstrip("."), family, keys, reason, fix)


def describe(layer: AttentionLayer, store: TensorStore, ctx: Context, row: Convention | None,
             notes: tuple[str, ...] = ()) -> AttentionLayer:
    """Positions, causal masking, scale and notes, from the model type's row."""
    entry, config, prefix = ctx.entry, ctx.config, ctx.prefix
    found = list(notes)
    positions = model_types.positions_of(entry, config, ctx.role, layer.head_dim)
    if row is not None:
        for key, meaning in row.positions_keys:
            if any(k == key or k.endswith("." + key) for k in store.keys()):
                positions = meaning
    if entry.position_key:
        kind = config.get(entry.position_key, "absolute")
        if kind in RELATIVE_TYPES or _holds(store, layer, prefix, "distance_embedding.weight"):
            positions = "relative bias"
            found.append(f"{entry.position_key} {printable(str(kind))!r}: a learned distance "
                         "embedding enters q·kᵀ (distance_embedding.weight)")
    if ctx.role != "cross" and any(_holds(store, layer, prefix, key) for key in RELATIVE_KEYS):
        positions = "relative bias"
    scale, scale_notes = model_types.scale_of(entry, config, layer.head_dim, ctx.index)
    found += scale_notes
    found += model_types.extra_notes(entry, config)
    found += _norm_notes(store, layer, prefix)
    if row is not None and ctx.role != "cross":
        found += [note for key, note in row.missing_notes if prefix + key not in store]
    if ctx.role == "cross":
        found.append("cross-attention: keys and values come from the encoder" +
                     ("; no position bias" if entry.positions == "relative bias" else ""))
    if row is not None and row.no_heads_note and not layer.heads_known:
        found.append(row.no_heads_note)
    return replace(layer, positions=positions, causal=model_types.is_causal(entry, config, ctx.role,
                                                                    ctx.tower),
                   scale=scale, notes=(*layer.notes, *found))


def _holds(store: TensorStore, layer: AttentionLayer, prefix: str, name: str) -> bool:
    """A tensor `name` beside the layer's weights: under its prefix or its W_q's module."""
    q_module = layer.q_weight.key.rsplit(".", 2)[0] + "." if "." in layer.q_weight.key else ""
    return prefix + name in store or (q_module.startswith(prefix) and q_module + name in store)


def _norm_notes(store: TensorStore, layer: AttentionLayer, prefix: str) -> list[str]:
    for q_name, k_name in NORMS:
        if prefix + q_name not in store:
            continue
        size = store.info(prefix + q_name).shape
        width = size[0] if len(size) == 1 else None
        if layer.head_dim is not None and width == layer.head_dim:
            span = f"per head (over d = {width})"
        elif width is not None and width == layer.q_out:
            span = (f"over the whole projection (H·d = {width}): one head's rows change the "
                    "normalization of every head")
        else:
            span = f"over {width if width is not None else '?'} features"
        return [f"q and k pass through {q_name.split('.')[0]} / {k_name} before the scores, "
                f"{span}"]
    return []
