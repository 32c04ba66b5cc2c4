"""config.json values that a model's own forward turns into NaN, checked before it runs.

A rope_theta of 0 or below makes the rotary frequencies infinite or NaN, a negative epsilon
lets a normalization divide by zero or take the root of a negative number: the maps come out
non-finite and would be blamed on the weights. The known fields are checked up front (in nested
configs too), each named when it is wrong.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attnviz.errors import CheckFailed, ConfigError, printable, quoted

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


# fields a model's forward computes with besides the weights: a value the checks above let
# through (a tiny epsilon, a huge rope_theta, a rope_scaling factor) can still overflow
HINT_FIELDS = POSITIVE_FIELDS | EPSILON_FIELDS | {"rope_scaling", "rope_parameters",
                                                  "attn_logit_softcapping", "query_pre_attn_scalar",
                                                  "scale_attn_weights", "attention_multiplier"}
MAX_HINTED = 6


def config_hint(folder: str | os.PathLike[str] | None) -> str:
    """'config.json fields that could cause this: rope_theta (10000.0), …' for the fields of
    the model folder's config.json its forward computes with ('' when it names none)."""
    if folder is None:
        return ""
    from attnviz.errors import AttnvizError
    from attnviz.load.checkpoint import read_json

    path = Path(folder)
    path = path / "config.json" if path.is_dir() else path.parent / "config.json"
    try:
        config = read_json(path, "config.json")
    except (AttnvizError, OSError, ValueError):
        return ""
    if not isinstance(config, dict):
        return ""
    found = [f"{path} ({printable(repr(value), 24)})" for path, name, value in _walk(config)
             if name in HINT_FIELDS and not isinstance(value, dict)][:MAX_HINTED]
    if not found:
        return ""
    return "config.json fields that could cause this: " + ", ".join(sorted(found))


@contextlib.contextmanager
def naming_config(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """A model's maps that come out non-finite name, beside the weights, the config.json fields
    its forward computes with (values known to give NaN were refused before the run)."""
    try:
        yield
    except CheckFailed as error:
        hint = config_hint(folder) if "finite" in error.what else ""
        if not hint:
            raise
        fix = f"{error.fix}; or check the {hint}" if error.fix else f"check the {hint}"
        raise CheckFailed(error.what, fix=fix, where=error.where, option=error.option) from None
