"""JSON from checkpoint folders (config.json, index files, safetensors headers, tokenizer.json),
parsed with every failure in attnviz's words.

Python's json module fails in ways its JSONDecodeError does not cover: nesting deeper than the
interpreter's recursion limit raises RecursionError, an integer of more than 4300 digits a plain
ValueError, and NaN, Infinity or 1e999 are accepted as floats that later arithmetic silently
propagates. Each of these is a CheckpointError here naming the file and, for non-finite numbers,
the field.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from attnviz.errors import CheckpointError, quoted


def parse_json(raw: bytes | str, what: str, where: str, *, finite: bool = True) -> Any:
    """Parse `raw`; with `finite`, refuse NaN/Infinity anywhere, naming the field."""
    fix = "fix or re-download it"
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{what} is not UTF-8 text (byte {exc.start})", fix=fix,
                              where=where) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what} is not valid JSON (line {exc.lineno}, column "
                              f"{exc.colno})", fix=fix, where=where) from None
    except RecursionError:
        raise CheckpointError(f"{what} nests arrays or objects deeper than "
                              f"{sys.getrecursionlimit()} levels", fix=fix, where=where) from None
    except ValueError:  # int digits beyond sys.get_int_max_str_digits()
        raise CheckpointError(f"{what} holds an integer with more digits than Python converts "
                              f"({_digit_limit()})", fix=fix, where=where) from None
    if finite:
        path = _first_non_finite(data)
        if path is not None:
            field, value = path
            raise CheckpointError(f"{what} field {quoted(field)} is {value}, not a finite "
                                  "number", fix="replace it with a number (JSON has no NaN or "
                                  "Infinity)", where=where)
    return data


def _digit_limit() -> int | str:
    getter = getattr(sys, "get_int_max_str_digits", None)
    return getter() if getter is not None else "its limit"


def _first_non_finite(data: Any) -> tuple[str, str] | None:
    """(dotted path, "NaN" | "Infinity" | "-Infinity") of the first non-finite float, or None.

    Iterative (the parser already bounded the depth; this walk must not recurse either)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "(top level)", "NaN" if math.isnan(value) else (
                "Infinity" if value > 0 else "-Infinity")
        if isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item)
                         for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None
