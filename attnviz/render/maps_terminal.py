"""Terminal heatmaps of attention maps, side by side, with token labels and a colour legend."""

from __future__ import annotations

import functools

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.compute.maps import MapView
from attnviz.errors import printable
from attnviz.render.elide import MAX_MAP_PANELS, MAX_TABLE_ROWS, elided, gap_note
from attnviz.render.safe import safe_text

# viridis anchors: 0 → dark purple, 1 → yellow
_RAMP = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
ROW_LABEL_WIDTH = 8
COL_LABEL_ROWS = 4
GAP = 3
LEVELS = 24  # colour levels of the terminal ramp


@functools.lru_cache(maxsize=1024)
def ramp(value: float) -> str:
    value = min(max(value, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(value), len(_RAMP) - 2)
    t = value - i
    rgb = [round(a + (b - a) * t) for a, b in zip(_RAMP[i], _RAMP[i + 1], strict=True)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def cell_width(cols: int, available: int) -> int:
    return 2 if cols * 2 + ROW_LABEL_WIDTH + 1 <= available else 1


def panel_lines(view: MapView, cell: int) -> list[Text]:
    rows, cols = view.values.shape
    width = ROW_LABEL_WIDTH + 1 + cols * cell
    # Tokens come from the user or a tokenizer: escaped before they are cut to fit.
    col_labels = [printable(label, COL_LABEL_ROWS + 1) for label in view.col_labels]
    row_labels = [printable(label, ROW_LABEL_WIDTH + 1) for label in view.row_labels]
    lines = [Text(printable(view.title, None)[:width].ljust(width), style="bold")]
    for r in range(min(COL_LABEL_ROWS, max(len(label) for label in col_labels))):
        text = Text(" " * (ROW_LABEL_WIDTH + 1))
        for label in col_labels:
            text.append((label[r] if r < len(label) else " ").ljust(cell), style="dim")
        lines.append(text)
    for label, row in zip(row_labels, view.values, strict=True):
        text = Text(label[:ROW_LABEL_WIDTH].rjust(ROW_LABEL_WIDTH) + " ", style="dim")
        # Runs of equal colour become one segment: terminals show 24 levels apart anyway, and
        # long rows of separate segments make rich slow.
        run_style, run_text = None, ""
        for value in row:
            if value == 0.0:
                style, chars = "grey27", "·".rjust(cell)  # masked (causal) or exactly zero
            else:
                style, chars = ramp(round(float(value) * LEVELS) / LEVELS), "█" * cell
            if style != run_style and run_text:
                text.append(run_text, style=run_style)
                run_text = ""
            run_style, run_text = style, run_text + chars
        if run_text:
            text.append(run_text, style=run_style)
        lines.append(text)
    return lines


def legend() -> Text:
    text = Text("weight  0 ")
    for i in range(21):
        text.append("█", style=ramp(i / 20))
    text.append(" 1   · = masked (0)   each row is one query and sums to 1", style="")
    return text


def print_maps(console: Console, views: list[MapView], sentences: list[str]) -> None:
    """Panels grouped by sentence, as many side by side as the terminal width allows."""
    width = console.width
    for b, sentence in enumerate(sentences):
        group = [v for v in views if v.sentence == b]
        if not group:
            continue
        console.print(safe_text(f"sentence {b + 1}: {sentence}", style="bold"),
                      overflow="fold")
        if any(v.downsampled for v in group):
            console.print(Text("downsampled to fit: labels a-b are token ranges; key blocks are "
                               "summed, query blocks averaged", style="dim"))
        cell = cell_width(group[0].values.shape[1], width)
        hidden = len(group) - MAX_MAP_PANELS
        panels = [panel_lines(v, cell) for v in group[:MAX_MAP_PANELS]]
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
        if hidden > 0:
            console.print(Text(f"… {hidden} more maps of sentence {b + 1} not shown (--head H "
                               "shows one, --out draws a figure)", style="dim"))
    console.print(legend())


def stats_table(stats: list) -> Table:
    """Per-head statistics with labels (see attnviz.compute.stats for the definitions)."""
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1),
                  caption_justify="left")
    for title in ("layer", "head", "entropy", "max", "dist", "first", "prev", "self", "dup",
                  "induct", "label"):
        table.add_column(title, justify="left" if title == "label" else "right", no_wrap=True)

    def num(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    for i in elided(len(stats)):
        if i is None:
            table.add_row(*["…"] * len(table.columns))
            table.caption = gap_note(len(stats), MAX_TABLE_ROWS, "rows")
            continue
        s = stats[i]
        table.add_row(str(s.layer), str(s.head), num(s.entropy), num(s.max_weight),
                      f"{s.distance:.1f}", num(s.first), num(s.previous), num(s.self),
                      num(s.duplicate), num(s.induction),
                      Text(s.label, style="bold green" if s.label else ""))
    return table


def print_stats(console: Console, stats: list) -> None:
    console.print(Text("head statistics (means over real query positions; entropy in nats, "
                       "dist = mean attended distance in tokens)", style="bold"))
    console.print(stats_table(stats))
    console.print(Text("first/prev/self = weight on token 0 / i-1 / i; dup = on earlier copies "
                       "of the query's token; induct = on the token after an earlier copy. A "
                       "head is labelled when one pattern takes ≥ 0.5 of its attention.",
                       style="dim"))


def _vector(values: list[float], shown: int = 4) -> str:
    head = ", ".join(f"{v:+.2f}" for v in values[:shown])
    return f"[{head}{', …' if len(values) > shown else ''}]"


def print_query(console: Console, breakdown, key_labels: list[str]) -> None:
    """One query token's per-head slices: q_h, each key's k_h, products, scores, weights."""
    b = breakdown
    console.print(safe_text(f"query {b.query} {b.token!r} of sentence {b.sentence + 1}, layer "
                       f"{b.layer}: each head works on its own d = {len(b.heads[0].q)} features "
                       f"of the projected query and key (scale {b.scale:.4g})", style="bold"))
    if b.positions != "none":
        console.print(safe_text(f"positions: {b.positions}; q_h and k_h below are after it",
                                style="dim"))
    for h in b.heads:
        console.print()
        projected = f"x_{b.query} · W_q[{h.q_rows[0]}:{h.q_rows[1]}]ᵀ (+ b)"
        if b.positions.startswith("RoPE"):
            projected = f"RoPE_{b.query}({projected})"
        console.print(Text(f"head {h.head}: q_{h.head} = {projected} = {_vector(h.q, 6)}"
                           + (f"   (kv head {h.kv_head})" if h.kv_head != h.head else "")))
        table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
        for title in ("key", "k_h", "q_h·k_h", "× scale", "weight"):
            table.add_column(title, justify="left" if title in ("key", "k_h") else "right",
                             no_wrap=True)
        best = max(range(len(h.weights)), key=h.weights.__getitem__)
        for j, label in enumerate(key_labels):
            masked = h.weights[j] == 0.0 and h.scores[j] != 0.0
            table.add_row(f"{j} {printable(label, 11)[:10]}", _vector(h.keys[j]),
                          f"{h.dots[j]:+.3f}",
                          f"{h.scores[j]:+.3f}", "masked" if masked else f"{h.weights[j]:.3f}",
                          style="bold" if j == best else "")
        console.print(table)
    console.print(Text(f"recomputed from the slices; max |Δ| against the maps above: "
                       f"{b.max_diff:.1e}", style="dim"))
