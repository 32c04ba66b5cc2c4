"""Terminal heatmaps of attention maps, side by side, with token labels and a legend.

With colour, a cell's colour is its place on the scale (viridis); without colour (output piped
or redirected, NO_COLOR, TERM=dumb) its shade glyph is (` ░▒▓█`), so the maps carry the same
information either way. Short maps label keys with their tokens written downwards; longer or
downsampled maps label them with index ticks and list the tokens in a key below.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.compute.display.scale import DEFAULT_SCALE, Scale, map_scale
from attnviz.compute.display.views import MapView
from attnviz.errors import printable
from attnviz.render.elide import MAX_MAP_PANELS, MAX_TABLE_ROWS, elided, gap_note

# Re-exported: cli/heatmap_cmd.py prints the --query breakdown through this module.

if TYPE_CHECKING:
    from attnviz.compute.measures.stats import HeadStats

# viridis anchors: 0 → dark purple, 1 → yellow
_RAMP = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
ROW_LABEL_WIDTH = 8
COL_LABEL_ROWS = 4
GAP = 3
LEVELS = 24  # colour levels of the terminal ramp
SHADES = " ░▒▓█"  # without colour: one glyph per fifth of the scale
STACK_LIMIT = 20  # maps with more keys than this (or downsampled ones) get index ticks
KEY_LIMIT = 512  # tokens listed in a long sentence's key
TICK_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


@functools.lru_cache(maxsize=1024)
def ramp(value: float) -> str:
    value = min(max(value, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(value), len(_RAMP) - 2)
    t = value - i
    rgb = [round(a + (b - a) * t) for a, b in zip(_RAMP[i], _RAMP[i + 1], strict=True)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def colour_off(console: Console) -> bool:
    """No colour reaches the reader: not a terminal, TERM=dumb, or NO_COLOR."""
    return console.color_system is None or console.no_color


def shade(position: float) -> str:
    """The glyph of a position on the scale, in [0, 1]."""
    return SHADES[min(len(SHADES) - 1, int(position * len(SHADES)))]


def cell_width(cols: int, available: int) -> int:
    return 2 if cols * 2 + ROW_LABEL_WIDTH + 1 <= available else 1


def uses_ticks(view: MapView) -> bool:
    """Index ticks (and a key of the tokens) instead of token labels written downwards."""
    return view.downsampled or view.values.shape[1] > STACK_LIMIT


def _spans(spans: tuple[tuple[int, int], ...] | None, count: int) -> list[tuple[int, int]]:
    return list(spans) if spans is not None else [(i, i + 1) for i in range(count)]


def _tokens(view: MapView) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return view.tokens or (tuple(view.row_labels), tuple(view.col_labels))


def _stack_lines(view: MapView, cell: int) -> list[Text]:
    """Each key's token written downwards, its first COL_LABEL_ROWS characters."""
    # Tokens come from the user or a tokenizer: escaped before they are cut to fit.
    col_labels = [printable(label, COL_LABEL_ROWS + 1) for label in view.col_labels]
    lines = []
    for r in range(min(COL_LABEL_ROWS, max(len(label) for label in col_labels))):
        text = Text(" " * (ROW_LABEL_WIDTH + 1))
        for label in col_labels:
            text.append((label[r] if r < len(label) else " ").ljust(cell), style="dim")
        lines.append(text)
    return lines


def _tick_line(view: MapView, cell: int) -> Text:
    """The index of the first token under every k-th column, k chosen so the numbers fit."""
    cols = view.values.shape[1]
    starts = [a for a, _ in _spans(view.col_spans, cols)]
    digits = len(str(max(starts)))
    step = next((k for k in TICK_STEPS if k * cell >= digits + 1), TICK_STEPS[-1])
    chars = [" "] * (cols * cell)
    for j in range(0, cols, step):
        label = str(starts[j])
        chars[j * cell : j * cell + len(label)] = label
    return Text(" " * (ROW_LABEL_WIDTH + 1) + "".join(chars[: cols * cell]), style="dim")


def _row_labels(view: MapView, ticks: bool) -> list[str]:
    if not ticks:
        return view.row_labels
    tokens = _tokens(view)[0]
    return [f"{a} {tokens[a]}" if b - a == 1 else f"{a}-{b - 1}"
            for a, b in _spans(view.row_spans, view.values.shape[0])]


def panel_lines(view: MapView, cell: int, scale: Scale | None = None, shades: bool = False,
                ticks: bool = False) -> list[Text]:
    """A panel: its title, key labels (tokens downwards, or index ticks), and one line per
    query row; cells coloured by their place on the scale, or shaded when `shades`."""
    scale = scale or map_scale(DEFAULT_SCALE, [view.values])
    rows, cols = view.values.shape
    width = ROW_LABEL_WIDTH + 1 + cols * cell
    lines = [Text(view.title[:width].ljust(width), style="bold")]
    lines += [_tick_line(view, cell)] if ticks else _stack_lines(view, cell)
    for label, row in zip(_row_labels(view, ticks), view.values, strict=True):
        # The label alone is dim: a dim base style would dim every cell of the row.
        text = Text()
        text.append(label[:ROW_LABEL_WIDTH].rjust(ROW_LABEL_WIDTH) + " ", style="dim")
        # Runs of equal style become one segment: terminals show 24 levels apart anyway, and
        # long rows of separate segments make rich slow.
        run_style: str | None = None
        run_text = ""
        for value in row:
            style: str | None
            if value == 0.0:
                style, chars = "grey50", "·".rjust(cell)  # masked (causal) or exactly zero
            else:
                position = scale.position(float(value))
                if shades:
                    style, chars = None, shade(position) * cell
                else:
                    style, chars = ramp(round(position * LEVELS) / LEVELS), "█" * cell
            if style != run_style and run_text:
                text.append(run_text, style=run_style)
                run_text = ""
            run_style, run_text = style, run_text + chars
        if run_text:
            text.append(run_text, style=run_style)
        lines.append(text)
    return lines


def _number(value: float) -> str:
    return f"{value:.2g}"


def legend(scale: Scale | None = None, shades: bool = False) -> Text:
    """How to read a cell: the colour ramp or the shade glyphs, in weights, and the scale."""
    scale = scale or map_scale("fixed", [])
    if shades:
        text = Text("weight  ' '")
        for i, glyph in enumerate(SHADES[1:], 1):
            text.append(f" < {_number(scale.weight_at(i / len(SHADES)))} ≤ {glyph}")
    else:
        text = Text(f"weight  {_number(scale.vmin)} ")
        for i in range(21):
            text.append("█", style=ramp(i / 20))
        text.append(f" {scale.vmax:.3g}")
    text.append("   · = masked (0)")
    text.append(f"\n{scale.describe()}; each row (one query) sums to 1", style="dim")
    return text


def token_key(tokens: tuple[str, ...]) -> Text:
    """The tokens of a long sentence by index, for reading index ticks."""
    text = Text("tokens  ", style="bold")
    shown = tokens[:KEY_LIMIT]
    text.append("  ".join(f"{i}:{token}" for i, token in enumerate(shown)))
    if len(tokens) > len(shown):
        text.append(f"  … {len(tokens) - len(shown)} more (--export or --html has them all)",
                    style="dim")
    return text


def print_maps(console: Console, views: list[MapView], sentences: list[str],
               scale: str | Scale = DEFAULT_SCALE, targets: list[str] | None = None) -> None:
    """Panels grouped by sentence, as many side by side as the terminal width allows; maps of
    another shape (an encoder-decoder's decoder and cross-attention) start a new row."""
    width = console.width
    if isinstance(scale, str):
        scale = map_scale(scale, [v.values for v in views])
    shades = colour_off(console)
    for b, sentence in enumerate(sentences):
        group = [v for v in views if v.sentence == b]
        if not group:
            continue
        console.print(Text(f"sentence {b + 1}: {sentence}", style="bold"), overflow="fold")
        if targets is not None:
            console.print(Text(f"target {b + 1}: {targets[b]}", style="bold"), overflow="fold")
        ticks = any(uses_ticks(v) for v in group)
        if any(v.downsampled for v in group):
            console.print(Text("downsampled to fit: labels a-b are token ranges; key blocks are "
                               "summed, query blocks averaged", style="dim"))
        hidden = len(group) - MAX_MAP_PANELS  # tens of thousands of heads: output stays bounded
        runs: list[list[MapView]] = []
        for view in group[:MAX_MAP_PANELS]:  # views of one shape and labels print side by side
            if runs and (runs[-1][0].values.shape, runs[-1][0].row_labels,
                         runs[-1][0].col_labels) == (view.values.shape, view.row_labels,
                                                     view.col_labels):
                runs[-1].append(view)
            else:
                runs.append([view])
        for run in runs:
            cell = cell_width(run[0].values.shape[1], width)
            panels = [panel_lines(v, cell, scale, shades, ticks) for v in run]
            panel_width = panels[0][0].cell_len
            per_row = max(1, (width + GAP) // (panel_width + GAP))
            for start in range(0, len(panels), per_row):
                row = panels[start : start + per_row]
                for line_parts in zip(*row, strict=True):
                    line = Text()
                    for i, part in enumerate(line_parts):
                        if i:
                            line.append(" " * GAP)
                        line.append_text(part)
                    console.print(line, no_wrap=True, crop=True)
                console.print()
        if ticks:
            console.print(token_key(_tokens(group[0])[1]))
            console.print()
        if hidden > 0:
            console.print(Text(f"… {hidden} more maps of sentence {b + 1} not shown (--head H "
                               "shows one, --out draws a figure)", style="dim"))
    console.print(legend(scale, shades))


STATS_COLUMNS = ("layer", "head", "ent", "max", "dist", "first", "prev", "next", "self", "dup",
                 "ind", "punc", "label")


def stats_table(stats: list[HeadStats]) -> Table:
    """Per-head statistics with labels (see attnviz.compute.measures.stats for the definitions).

    Fits 80 columns: short headers, one space between columns; numbers are never cut (each
    numeric column is as wide as its widest number), only a label could be."""
    def num(value: float | None, digits: int = 2) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    rows = [[s.layer_label or str(s.layer), str(s.head), num(s.entropy), num(s.max_weight),
             num(s.distance, 1), num(s.first), num(s.previous), num(s.next), num(s.self),
             num(s.duplicate), num(s.induction), num(s.punctuation)]
            for s in stats]
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1, 0, 0),
                  caption_justify="left")
    for i, title in enumerate(STATS_COLUMNS[:-1]):
        table.add_column(title, justify="right", no_wrap=True,
                         min_width=max([len(title), *(len(row[i]) for row in rows)]))
    table.add_column(STATS_COLUMNS[-1], no_wrap=True)
    for shown in elided(len(stats)):  # tens of thousands of heads: the table stays bounded
        if shown is None:
            table.add_row(*["…"] * len(table.columns))
            table.caption = gap_note(len(stats), MAX_TABLE_ROWS, "rows")
            continue
        label = stats[shown].label
        table.add_row(*rows[shown], Text(label, style="bold green" if label else ""))
    return table


def print_stats(console: Console, stats: list[HeadStats]) -> None:
    console.print(Text("head statistics (means over real query positions)", style="bold"))
    console.print(stats_table(stats))
    console.print(Text("ent = entropy (nats); max = largest weight; dist = mean attended "
                       "distance (tokens); first/prev/self = weight on token 0 / i-1 / i; dup = "
                       "on earlier copies of the query's token; ind = on the token after an "
                       "earlier copy (induction). A head is labelled when one pattern takes "
                       "≥ 0.5 of its attention.", style="dim"))
