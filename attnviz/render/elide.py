"""What the terminal shows of long lists: output stays O(shown), not O(heads).

A layer may have tens of thousands of heads (a header is cheap to write); tables and maps show
the first rows and the last few, with one line saying how many are left out and where to find
them all (--json lists every head).
"""

from __future__ import annotations

__all__ = ["MAX_MAP_PANELS", "MAX_TABLE_ROWS", "elided", "gap_note"]

MAX_TABLE_ROWS = 64  # per-head rows of one table
MAX_MAP_PANELS = 32  # terminal heatmap panels per sentence


def elided(count: int, limit: int = MAX_TABLE_ROWS) -> list[int | None]:
    """Indices to show out of `count`: all of them, or the first ones, None (the gap), and the
    last `limit // 8`."""
    if count <= limit:
        return list(range(count))
    tail = max(1, limit // 8)
    return [*range(limit - tail), None, *range(count - tail, count)]


def gap_note(count: int, shown: int, what: str = "heads", where: str = "--json lists all") -> str:
    return f"… {count - shown} more {what} not shown ({where})"
