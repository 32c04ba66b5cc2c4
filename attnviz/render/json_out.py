"""--json output: strict JSON (RFC 8259), whatever the numbers.

Python's json writes NaN and Infinity as bare words no JSON parser accepts. Here every non-finite
float becomes null, and the document gains `"non_finite_values": {path: "NaN" | "Infinity" |
"-Infinity"}` saying which fields they were (`head_stats[3].entropy`), so nothing is hidden.
Strings are written ASCII-only: control characters, bidi overrides and every non-ASCII character
are \\u escapes, so the text is safe for any terminal and any encoding.
"""

from __future__ import annotations

import json
import math
from typing import Any

NON_FINITE_FIELD = "non_finite_values"


def _clean(value: Any, path: str, found: dict[str, str]) -> Any:
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        found[path or "$"] = "NaN" if math.isnan(value) else (
            "Infinity" if value > 0 else "-Infinity")
        return None
    if isinstance(value, dict):
        return {key: _clean(item, f"{path}.{key}" if path else str(key), found)
                for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(item, f"{path}[{i}]", found) for i, item in enumerate(value)]
    return value


def strict_json(doc: dict[str, Any]) -> str:
    """`doc` as indented strict JSON, non-finite numbers replaced by null and listed."""
    found: dict[str, str] = {}
    clean = _clean(doc, "", found)
    if found:
        clean[NON_FINITE_FIELD] = found
    return json.dumps(clean, indent=2, allow_nan=False, ensure_ascii=True)
