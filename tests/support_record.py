"""What the zoo tests established per architecture, for scripts/support_table.py: tests call
`record(kind, fact=value)`; with ATTNVIZ_SUPPORT_JSON set, conftest writes the facts there when
the session ends (every test module contributes: inspect, split, heatmap, --query, --verify)."""

from __future__ import annotations

import json
import os
from typing import Any

RESULTS: dict[str, dict[str, Any]] = {}


def record(kind: str, **facts: Any) -> None:
    from zoo import ZOO

    RESULTS.setdefault(kind, {"model_class": ZOO[kind].model_class,
                              "index": list(ZOO).index(kind)}).update(facts)


def write() -> None:
    path = os.environ.get("ATTNVIZ_SUPPORT_JSON")
    if path and RESULTS:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(RESULTS, out, indent=1, sort_keys=True)
