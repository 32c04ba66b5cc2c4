"""`attnviz patch` in the terminal: the pair and the metric, both baselines and the scale, then
one grid per sweep (layers × heads, layers × positions, heads × positions) with its direction,
a legend, and the top cells named. Grids too wide for a terminal show their top cells only."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.compute.patching.result import DIRECTIONS, EffectGrid, PatchResult
from attnviz.errors import printable, with_options
from attnviz.render.maps_terminal import colour_off, ramp

MAX_COLS = 24  # wider grids: their top cells only
MAX_ROWS = 64
LEGEND = ("cells: the patched run's metric on the normalized scale, 0 = the corrupted run, "
          "1 = the clean run (mean over pairs ± their standard deviation)")


def _shown(names: list[str]) -> str:
    return " ".join(printable(n, 24) for n in names)


def print_patch(console: Console, result: PatchResult) -> None:
    """Everything in the result, in reading order."""
    b = result.baselines
    console.print(Text(f"activation patching: {printable(result.model, 120)}", style="bold"),
                  overflow="fold")
    first = result.pairs[0]
    console.print(Text(f"clean:     {_shown(first.clean)}"), overflow="fold")
    console.print(Text(f"corrupted: {_shown(first.corrupt)}"), overflow="fold")
    wrong = f"  wrong: {printable(first.wrong, 24)}" if first.wrong is not None else ""
    console.print(Text(f"answer: {_shown(first.answer)}{wrong}"
                       + (f"   ({len(result.pairs)} pairs; the first shown)"
                          if len(result.pairs) > 1 else "")), overflow="fold")
    console.print(Text(f"metric: {result.metric} = {b.explained}"), overflow="fold")
    console.print(Text(f"baselines: clean {b.clean_mean:.4f}, corrupted {b.corrupt_mean:.4f}"
                       + (" (means over pairs)" if len(b.clean) > 1 else "")
                       + f"; normalized scale: 0 = corrupted, 1 = clean (unit "
                       f"{b.scale:+.4f})"), overflow="fold")
    if b.scale == 0 or not math.isfinite(b.scale):
        console.print(Text("the clean and corrupted runs score the same: nothing to restore, "
                           "every normalized cell is undefined", style="yellow"), overflow="fold")
    colour = not colour_off(console)
    several = len(b.clean) > 1
    for grid in result.grids:
        console.print()
        console.print(Text(grid.title, style="bold"), overflow="fold")
        console.print(Text(f"direction: {DIRECTIONS[grid.direction]}", style="dim"),
                      overflow="fold")
        if len(grid.cols) <= MAX_COLS and len(grid.rows) <= MAX_ROWS:
            console.print(grid_table(grid, colour, several))
        else:
            console.print(Text(f"{len(grid.rows)} × {len(grid.cols)} cells: the top ones "
                               "below, every cell in --json", style="dim"), overflow="fold")
        for note in grid.col_notes + grid.notes:
            console.print(Text(f"  {note}", style="dim"), overflow="fold")
        top = ", ".join(f"{r} {c} {m:.2f}" + (f"±{s:.2f}" if several else "")
                        for r, c, m, s in grid.top())
        console.print(Text(f"top: {printable(top, 400)}"), overflow="fold")
    console.print()
    console.print(Text(LEGEND, style="dim"), overflow="fold")
    console.print(Text(f"{result.forwards} forward passes, up to {result.per_forward} patched "
                       "copies of the batch in one", style="dim"), overflow="fold")
    for note in result.notes:
        shown = with_options(note, lambda name: "--" + name.replace("_", "-"))
        console.print(Text(f"note: {shown}"), overflow="fold")


def grid_table(grid: EffectGrid, colour: bool, spread: bool) -> Table:
    """rows × cols; each cell coloured by its distance from 0 (corrupted) toward 1 (clean)."""
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("", justify="right", style="dim")
    for col in grid.cols:
        table.add_column(printable(col, 16), justify="right")
    for i, row in enumerate(grid.rows):
        cells = []
        for j in range(len(grid.cols)):
            value = grid.mean[i][j]
            if not math.isfinite(value):
                cells.append(Text("n/a"))
                continue
            text = f"{value:.2f}" + (f"±{grid.spread[i][j]:.2f}" if spread else "")
            cells.append(Text(text, style=ramp(min(1.0, abs(value))) if colour else ""))
        table.add_row(row, *cells)
    return table
