"""Reading Hugging Face config.json facts the layout families share (not a family itself).

Values are read as transformers reads them: a missing key means the config class's default, and a
JSON null counts as missing.
"""

from __future__ import annotations

import math
from typing import Any

from attnviz.errors import LayoutError, printable

# Sub-configs of multi-tower models, and the key fragments that mark a tower's tensors.
TOWERS = (("vision", "vision_config"), ("visual", "vision_config"), ("text", "text_config"),
          ("language_model", "text_config"), ("audio", "audio_config"))


def model_type(config: dict[str, Any]) -> str | None:
    value = config.get("model_type")
    return value if isinstance(value, str) else None


def flag(config: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean config field; anything but true/false/null is a broken config."""
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LayoutError(f"config.json field {name!r} is {printable(repr(value))}, expected "
                          "true or false", "fix config.json")
    return value


def number(config: dict[str, Any], name: str, default: float | None) -> float | None:
    """A positive numeric config field (int or float)."""
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 < value < math.inf):
        raise LayoutError(f"config.json field {name!r} is {printable(repr(value))}, expected a "
                          "positive finite number", "fix config.json")
    return float(value)


def tower_config(config: dict[str, Any], prefix: str) -> tuple[str | None, dict[str, Any]]:
    """(tower name, config) for a layer: CLIP-style models nest each tower's head counts."""
    parts = prefix.lower().split(".")
    for fragment, key in TOWERS:
        nested = config.get(key)
        if isinstance(nested, dict) and any(fragment in part for part in parts):
            return fragment if fragment != "visual" else "vision", nested
    return None, config


def rotary_fraction(config: dict[str, Any], *names: str, default: float = 1.0) -> float:
    """The share of each head's dims that RoPE rotates (rotary_pct, partial_rotary_factor)."""
    nested = config.get("rope_parameters")
    sources = [config] + ([nested] if isinstance(nested, dict) else [])
    for source in sources:
        for name in names:
            value = number(source, name, None)
            if value is not None:
                return value
    return default


def rope_label(fraction: float) -> str:
    """"rope", or "rope (partial, 25%)" when only part of each head is rotated."""
    if fraction >= 1.0:
        return "rope"
    return f"rope (partial, {round(100 * fraction)}%)"
