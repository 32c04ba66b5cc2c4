"""The model-type table (`attnviz.recognize.model_type_table`) read against a config.json: head
counts, positions, causal masking, scale, sliding windows and notes for one layer.

The table's names its callers use (MODEL_TYPES, GENERIC, ModelType, Packing and the packings
conventions name) are re-exported here: `model_types` stays the one place they ask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from attnviz.errors import ConfigError, LayoutError, printable
from attnviz.load.config import TOWERS, count, flag, number, rope_label, rotary_fraction
from attnviz.recognize.model_type_table import (
    GENERIC,
    MODEL_TYPES,
    ROLE_HEADS,
    TOWER_SUFFIXES,
    ConfigScale,
    ModelType,
)

MAX_HEADS = 1 << 16  # far above any real model; keeps loops over heads bounded


def base_type(kind: str | None, tower: str | None = None) -> tuple[str | None, str | None]:
    """(model_type, tower) with a tower suffix removed: clip_text_model → (clip, text)."""
    for suffix, name in TOWER_SUFFIXES:
        if kind and kind.endswith(suffix) and kind[: -len(suffix)] in MODEL_TYPES:
            return kind[: -len(suffix)], tower or name
    return kind, tower


def lookup(kind: str | None) -> ModelType | None:
    return MODEL_TYPES.get(kind) if kind is not None else None


def family_of(kind: str) -> str:
    entry = MODEL_TYPES[kind]
    return entry.family or kind


@dataclass(frozen=True)
class Heads:
    """Head counts found in config.json, and what was set aside (not a count for this layer)."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def config_heads(entry: ModelType, config: dict[str, Any], role: str) -> Heads:
    """The head counts config.json gives a layer of this model type and role."""
    notes: list[str] = []
    heads = _count(config, ROLE_HEADS.get(role, ()) + entry.heads, notes)
    kv = _count(config, entry.kv_heads, notes)
    dim = _count(config, entry.head_dim, notes)
    return Heads(heads, kv, dim, tuple(notes))


def _count(config: dict[str, Any], names: tuple[str, ...], notes: list[str]) -> int | None:
    """The first of `names` holding a head count. A list (Swin's heads per stage) is not one."""
    for name in names:
        value = config.get(name)
        if isinstance(value, list):
            notes.append(f"config.json's {name} is a list ({printable(repr(value), 60)}), one per "
                         "stage, not this layer's count")
            continue
        found = count(config, name, limit=MAX_HEADS)
        if found is not None:
            return found
    return None


def check_config(config: dict[str, Any]) -> None:
    """Every head count, size and window config.json (or a tower of it) holds is a positive
    integer, whatever the model_type: a broken config is reported even where no layer reads it.
    A list of counts (Swin's heads per stage) is allowed; its items are checked."""
    keys = {key for entry in (*MODEL_TYPES.values(), GENERIC)
            for key in (*entry.heads, *entry.kv_heads, *entry.head_dim)}
    keys |= {key for names in ROLE_HEADS.values() for key in names}
    for nested in [config, *(config.get(key) for _, key in TOWERS)]:
        if not isinstance(nested, dict):
            continue
        for key in sorted(keys):
            value = nested.get(key)
            items = value if isinstance(value, list) else [value]
            for item in items:
                count({key: item}, key, limit=MAX_HEADS * 1024)


def positions_of(entry: ModelType, config: dict[str, Any], role: str,
                 head_dim: int | None) -> str:
    """Where positions enter this layer's attention, as inspect states it."""
    if role == "cross" and entry.positions == "relative bias":
        return "none"  # T5: cross-attention has no relative bias
    if role == "encoder" and entry.encoder_positions:
        return entry.encoder_positions
    if entry.alibi_flag and flag(config, entry.alibi_flag, False):
        return "alibi"
    if entry.positions != "rope":
        return entry.positions
    return rope_label(layer_rotary_fraction(entry, config, head_dim))


def layer_rotary_fraction(entry: ModelType, config: dict[str, Any], head_dim: int | None) -> float:
    """The share of each head's dims RoPE rotates (GPT-J/CodeGen: rotary_dim / d)."""
    if entry.rotary_dim is not None and head_dim:
        key, default = entry.rotary_dim
        dims = count(config, key, limit=MAX_HEADS * 1024)
        return min(1.0, (dims if dims is not None else default) / head_dim)
    fraction = rotary_fraction(config, *entry.rotary, default=entry.rotary_default)
    if fraction > 1.0:
        raise ConfigError(f"config.json gives a rotary fraction of {fraction:g}, above 1",
                          fix="fix config.json")
    return fraction


def is_causal(entry: ModelType, config: dict[str, Any], role: str, tower: str | None) -> bool:
    if role == "cross":
        return False  # keys are the encoder's: nothing to hide
    rule = entry.causal
    if rule == "always":
        return True
    if rule == "decoder":
        return role == "decoder"
    if rule in ("is_decoder", "causal"):  # a config flag of that name
        return flag(config, rule, False)
    if rule == "text":
        return tower == "text"
    return False


def scale_of(entry: ModelType, config: dict[str, Any], head_dim: int | None,
             index: int | None) -> tuple[float | None, tuple[str, ...]]:
    """(scale multiplying q·kᵀ or None for 1/√d, notes) for layer `index` of this model."""
    rule = entry.scale
    if rule is None:
        return None, ()
    if isinstance(rule, float):
        return rule, ()
    if isinstance(rule, ConfigScale):
        return number(config, rule.key, rule.default) ** rule.power, ()
    if rule == "deberta":
        if not flag(config, "relative_attention", False) or not head_dim:
            return None, ()
        kinds = config.get("pos_att_type") or []
        kinds = [kinds] if isinstance(kinds, str) else kinds
        factor = 1 + sum(kind in kinds for kind in ("c2p", "p2c")) if isinstance(kinds, list) \
            else 1
        return (head_dim * factor) ** -0.5, ()
    # "gpt2": GPT2Attention's optional scalings, none at all or an extra 1/(layer_idx + 1)
    if not flag(config, "scale_attn_weights", True):
        return 1.0, ("scale_attn_weights is false: q·kᵀ is not divided by √d",)
    if flag(config, "scale_attn_by_inverse_layer_idx", False) and index is not None:
        if head_dim is None:
            return None, (f"scores are also divided by layer_idx + 1 = {index + 1}",)
        return 1.0 / (math.sqrt(head_dim) * (index + 1)), ()
    return None, ()


def window_note(entry: ModelType, config: dict[str, Any]) -> str | None:
    window = count(config, "sliding_window")
    if not entry.window or window is None or not flag(config, "use_sliding_window", True):
        return None
    return f"sliding-window attention over {window} keys on some or all layers"


def extra_notes(entry: ModelType, config: dict[str, Any]) -> tuple[str, ...]:
    """Notes for inspect. A malformed value here is reported in the note, not raised: inspect
    does not compute with it (the commands that do refuse it where they use it)."""
    notes = list(entry.notes)
    if entry.softcap:
        try:
            cap = number(config, entry.softcap, None)
        except LayoutError as exc:
            notes.append(f"{exc.what} (ignored here)")
        else:
            if cap:
                notes.append(f"scores are soft-capped: s ← {cap}·tanh(s/{cap})")
    try:
        window = window_note(entry, config)
    except LayoutError as exc:
        window = f"{exc.what} (ignored here)"
    if window:
        notes.append(window)
    return tuple(notes)


def sliding_window(config: dict[str, Any], kind: str | None, index: int) -> int | None:
    """The sliding window of layer `index` of a model of this type, or None for full attention."""
    entry = lookup(kind)
    window = count(config, "sliding_window")
    if entry is None or not entry.window or window is None:
        return None
    types = config.get("layer_types")  # transformers 5 writes the per-layer choice out
    if isinstance(types, list) and index < len(types):
        return window if types[index] == "sliding_attention" else None
    if entry.window == "always":
        return window
    if entry.window == "opt-in":  # Qwen2: with use_sliding_window, from max_window_layers on
        start = count(config, "max_window_layers", minimum=0)
        start = 28 if start is None else start  # Qwen2Config's default
        return window if flag(config, "use_sliding_window", False) and index >= start \
            else None
    return None
