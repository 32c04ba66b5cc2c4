"""The layers × heads overview in the terminal: one row per layer, one cell per head, each cell
the head's type as a short word (or one statistic as a number), with a key.

Without colour (piped, NO_COLOR, TERM=dumb) the words and numbers carry everything; colour only
repeats them. Cells are as wide as their longest word or number (numbers are never cut): when a
row of heads does not fit the console, types switch to 3-letter codes, and what still does not
fit wraps into blocks of heads, each under its own header of head numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from attnviz.compute.measures.stats import LABEL_THRESHOLD, MIN_LABEL_QUERIES
from attnviz.render.elide import MAX_TABLE_ROWS, elided, gap_note
from attnviz.render.maps_terminal import colour_off, ramp

if TYPE_CHECKING:
    from attnviz.compute.measures.overview import Overview, OverviewCell

# type → (word, 3-letter code, what it means, colour)
TYPES: dict[str, tuple[str, str, str, str]] = {
    "previous-token": ("prev", "prv", "the previous token", "cyan"),
    "first-token": ("first", "1st", "token 0 ([CLS], <s>)", "green"),
    "last-token": ("last", "lst", "the final token ([SEP], </s>)", "yellow"),
    "special-token": ("spec", "spc", "special tokens together", "magenta"),
    "self": ("self", "slf", "its own token", "blue"),
    "duplicate-token": ("dup", "dup", "earlier copies of its token", "red"),
    "induction": ("ind", "ind", "the token after an earlier copy (induction)", "bold red"),
    "next-token": ("next", "nxt", "the token after it", "bright_cyan"),
    "punctuation": ("punct", "pct", "punctuation (. , ; : ! ?)", "bright_yellow"),
    "broad": ("broad", "brd", "no key takes half a query's weight", "dim"),
    "other": ("other", "oth", "sharp, on keys no listed pattern explains", ""),
}
MAX_HEADS = 128  # heads shown per layer; --json lists every head
LAYER_TITLE = "layer"


def _number(value: float | None, shows: str) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" if shows == "distance" else f"{value:.2f}"


def _words(overview: Overview, short: bool) -> list[list[str]]:
    if overview.statistic is not None:
        return [[_number(c.value, overview.shows) for c in r.cells[:MAX_HEADS]]
                for r in overview.rows]
    return [[TYPES[c.type][1 if short else 0] for c in r.cells[:MAX_HEADS]]
            for r in overview.rows]


def layout(overview: Overview, width: int) -> tuple[list[list[str]], int, int, int, bool]:
    """(cell texts, label width, cell width with its gap, heads per block, whether types are
    3-letter codes) for `width`."""
    label_width = max([len(LAYER_TITLE), *(len(r.label) for r in overview.rows)])
    heads = max((len(r.cells[:MAX_HEADS]) for r in overview.rows), default=0)
    words: list[list[str]] = []
    per_block = cell = 1
    for short in (False, True):
        words = _words(overview, short)
        cell = 1 + max([len(str(heads - 1)), *(len(w) for row in words for w in row)])
        per_block = max(1, (width - label_width) // cell)
        if per_block >= heads or overview.statistic is not None:
            break
    blocks = -(-heads // per_block) if heads else 1
    per_block = -(-heads // blocks) if heads else 1  # blocks of even size: 6 + 6, not 11 + 1
    return words, label_width, cell, per_block, short


def _style(overview: Overview, cell: OverviewCell, top: float, colour: bool) -> str:
    if not colour:
        return ""
    if overview.statistic is None:
        return TYPES[cell.type][3]
    if cell.value is None or top <= 0:
        return "dim"
    return ramp(min(max(cell.value / top, 0.0), 1.0))


def overview_lines(overview: Overview, width: int, colour: bool = False) -> list[Text]:
    """The grid: per block of heads a header of head numbers, then one line per layer."""
    words, label_width, cell, per_block, _ = layout(overview, width)
    heads = max((len(r.cells[:MAX_HEADS]) for r in overview.rows), default=0)
    top = max((c.value for r in overview.rows for c in r.cells if c.value is not None),
              default=0.0)
    numeric = overview.statistic is not None
    lines: list[Text] = []
    for start in range(0, heads, per_block):
        stop = min(heads, start + per_block)
        if start:
            lines.append(Text())
        header = Text(LAYER_TITLE.rjust(label_width), style="bold")
        for head in range(start, stop):
            header.append(str(head).rjust(cell) if numeric else " " + str(head).ljust(cell - 1),
                          style="bold")
        header.rstrip()
        lines.append(header)
        for shown in elided(len(overview.rows), MAX_TABLE_ROWS):
            if shown is None:
                lines.append(Text("…".rjust(label_width), style="dim"))
                continue
            row = overview.rows[shown]
            line = Text()  # the label alone is dim: a dim base style would dim every cell
            line.append(row.label.rjust(label_width), style="dim")
            for c, text in list(zip(row.cells, words[shown], strict=False))[start:stop]:
                line.append(text.rjust(cell) if numeric else " " + text.ljust(cell - 1),
                            style=_style(overview, c, top, colour))
            line.rstrip()
            lines.append(line)
    return lines


def overview_key(overview: Overview, width: int) -> list[Text]:
    """What the cells mean: the words that occur (as the grid for `width` writes them), or
    the statistic's meaning."""
    if overview.statistic is not None:
        return [Text(f"cells: {overview.meaning}; means over real query positions; – : not "
                     "defined for this layer or input (cross-attention, or no query exercised "
                     "the pattern)", style="dim")]
    present = {c.type for r in overview.rows for c in r.cells[:MAX_HEADS]}
    key = Text("key  ")
    short = layout(overview, width)[4]
    shown = [described for name, described in TYPES.items() if name in present]
    for i, (word, code, meaning, _) in enumerate(shown):
        key.append(" · " if i else "")
        key.append(code if short else word, style="bold")
        key.append(f" {meaning}")
    return [key, Text(f"a head is named by the pattern taking ≥ {LABEL_THRESHOLD} "
                      "of its attention (the strongest), over ≥ "
                      f"{MIN_LABEL_QUERIES} queries that exercised it; --overview entropy, max, "
                      "previous, … shows one statistic; --layer N or --maps shows the maps, "
                      "--stats the table", style="dim")]


def print_overview(console: Console, overview: Overview) -> None:
    """Title, grid and key; a note when layers or heads were left out."""
    what = "head types" if overview.statistic is None else overview.shows
    console.print(Text(f"overview: {what}, layers × heads", style="bold"))
    for line in overview_lines(overview, console.width, not colour_off(console)):
        console.print(line, no_wrap=True, crop=False)
    hidden = max((len(r.cells) for r in overview.rows), default=0) - MAX_HEADS
    if hidden > 0:
        console.print(Text(gap_note(hidden + MAX_HEADS, MAX_HEADS), style="dim"))
    if len(overview.rows) > MAX_TABLE_ROWS:
        console.print(Text(gap_note(len(overview.rows), MAX_TABLE_ROWS, "layers"), style="dim"))
    for line in overview_key(overview, console.width):
        console.print(line, overflow="fold")
