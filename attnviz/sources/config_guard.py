"""config.json values that a model's own forward turns into NaN, checked before it runs.

A rope_theta of 0 or below makes the rotary frequencies infinite or NaN, a negative epsilon
lets a normalization divide by zero or take the root of a negative number: the maps come out
non-finite and would be blamed on the weights. The known fields are checked up front (in nested
configs too), each named when it is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from attnviz.errors import ConfigError, printable, quoted

# fields that must be a finite number > 0 (rotary bases, scaling factors)
POSITIVE_FIELDS = frozenset({"rope_theta", "rotary_emb_base", "rope_base", "rotary_base",
                             "global_rope_theta", "local_rope_theta", "rope_local_base_freq",
                             "factor"})
# epsilons: a finite number >= 0 (0 is legal; a negative one takes the root of a negative)
EPSILON_FIELDS = frozenset({"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
                            "layernorm_epsilon", "norm_epsilon", "epsilon"})
MAX_DEPTH = 8


def _walk(config: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(dotted path, field name, value) of every field, nested configs included."""
    stack: list[tuple[str, Any, int]] = [("", config, 0)]
    while stack:
        path, value, depth = stack.pop()
        if not isinstance(value, dict) or depth > MAX_DEPTH:
            continue
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            yield child, str(key), item
            stack.append((child, item, depth + 1))


def check_config_values(config: dict[str, Any], where: str) -> None:
    """Refuse, naming the field, a value the model's forward would turn into NaN."""
    for path, name, value in _walk(config):
        positive = name in POSITIVE_FIELDS
        if not positive and name not in EPSILON_FIELDS:
            continue
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config.json field {quoted(path)} is {printable(repr(value), 40)}"
                              ", not a number", fix="fix config.json", where=where)
        if not math.isfinite(value) or (value <= 0 if positive else value < 0):
            need = "a positive number" if positive else "a number >= 0"
            raise ConfigError(f"config.json field {quoted(path)} is {value!r}, it must be {need}"
                              " (the model's forward would compute NaN from it)",
                              fix="fix config.json", where=where)

