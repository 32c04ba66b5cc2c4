"""Reading Hugging Face config.json facts the layout families share (not a family itself).

Values are read as transformers reads them: a missing key means the config class's default, and a
JSON null counts as missing.
"""

from __future__ import annotations

import math
from typing import Any, overload

from attnviz.errors import ConfigError, printable

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
        raise ConfigError(f"config.json field {name!r} is {printable(_short_repr(value), 60)}, "
                          "expected true or false", fix="fix config.json")
    return value


@overload
def number(config: dict[str, Any], name: str, default: float) -> float: ...


@overload
def number(config: dict[str, Any], name: str, default: None) -> float | None: ...


def number(config: dict[str, Any], name: str, default: float | None) -> float | None:
    """A positive numeric config field (int or float)."""
    value = config.get(name)
    if value is None:
        return default
    parsed = _as_float(value)
    if parsed is None or parsed <= 0 or not math.isfinite(parsed):
        raise ConfigError(f"config.json field {name!r} is {printable(_short_repr(value), 60)}, "
                          "expected a positive number", fix="fix config.json")
    return parsed


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range
        return None


def count(config: dict[str, Any], name: str, *, minimum: int = 1,
          limit: int | None = None) -> int | None:
    """An integer config field (a head count, a size) of at least `minimum` and at most `limit`;
    JSON null counts as absent. Floats, booleans and strings are a broken config, not a count."""
    value = config.get(name)
    if value is None:
        return None
    if type(value) is not int or value < minimum or (limit is not None and value > limit):
        bound = f"an integer ≥ {minimum}" if minimum != 1 else "a positive integer"
        if limit is not None:
            bound += f" and ≤ {limit}"
        raise ConfigError(f"config.json field {name!r} is {printable(_short_repr(value), 60)}, "
                          f"expected {bound}", fix="fix config.json")
    return value


def _short_repr(value: Any) -> str:
    """repr, without building the digits of a huge integer (Python refuses past 4300 of them)."""
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    return repr(value)


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
