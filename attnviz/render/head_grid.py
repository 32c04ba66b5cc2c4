"""A layers × heads grid of short cells for the terminal (corpus and compare): a header of head
numbers over one line per layer, wrapped into blocks of heads that fit the width, and the short
numbers its cells hold."""

from __future__ import annotations

from rich.text import Text

Row = tuple[str, list[tuple[str, str]]]  # a layer's label, its cells (text, style)
LABEL_TITLE = "layer"


def _label_width(rows: list[Row]) -> int:
    return max([len(LABEL_TITLE), *(len(label) for label, _ in rows)])


def _cell_width(rows: list[Row]) -> int:
    heads = max((len(cells) for _, cells in rows), default=0)
    return 1 + max([len(str(max(heads - 1, 0))),
                    *(len(text) for _, cells in rows for text, _ in cells)])


def heads_per_block(rows: list[Row], width: int) -> int:
    """How many heads' cells fit beside the labels in `width` columns (at least one)."""
    return max(1, (width - _label_width(rows)) // _cell_width(rows))


def grid_lines(rows: list[Row], width: int) -> list[Text]:
    """Rows of cells under a header of head numbers, wrapped into blocks of heads that fit."""
    label_width, cell = _label_width(rows), _cell_width(rows)
    heads = max((len(cells) for _, cells in rows), default=0)
    per_block = heads_per_block(rows, width)
    lines: list[Text] = []
    for start in range(0, heads, per_block):
        stop = min(heads, start + per_block)
        header = Text(LABEL_TITLE.ljust(label_width))
        for h in range(start, stop):
            header.append(str(h).rjust(cell))
        lines.append(header)
        for label, cells in rows:
            line = Text(label.ljust(label_width))
            for text, style in cells[start:stop]:
                line.append(text.rjust(cell), style=style)
            lines.append(line)
    return lines


def short_number(value: float, sign: bool = False) -> str:
    """A number for a cell: .53, 1.2, 14 (with `sign`: +.05, -.10); never "-.00"."""
    magnitude = abs(value)
    if magnitude >= 10:
        text = f"{magnitude:.0f}"
    elif magnitude >= 1:
        text = f"{magnitude:.1f}"
    else:
        text = f"{magnitude:.2f}".replace("0.", ".", 1)
    if value < 0 and text.strip(".0"):
        return "-" + text
    return ("+" + text) if sign else text
