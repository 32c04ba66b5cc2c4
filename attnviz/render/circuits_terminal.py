"""`attnviz circuits` in the terminal: the header (source, conventions, what was folded), a table
of every head's QK and OV circuit, and the Q-, K-, V-composition grids with heads above the
baseline marked."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnviz.compute.qkov.circuits_result import (
    CONVENTIONS,
    COPYING_LINE,
    CircuitsResult,
    CompositionGrid,
    LayerCircuits,
)
from attnviz.errors import elide_at_boundaries, printable
from attnviz.render.safe import safe_text

SHOWN_SINGULAR = 2  # top singular values per circuit in the table
MAX_GRIDS = 6  # composition grids per kind in the terminal; the rest: --json, --out
KIND_TEXT = {"K": "K-composition: ‖W_QK^b W_OV^a‖ (b's keys read what a wrote)",
             "Q": "Q-composition: ‖(W_OV^a)ᵀ W_QK^b‖ (b's queries read what a wrote)",
             "V": "V-composition: ‖W_OV^b W_OV^a‖ (b's values read what a wrote)"}


SOURCE_LEAD = "circuits of "


def header(result: CircuitsResult, width: int | None = None) -> RenderableType:
    """The header; with `width` (the console's), the source on one line: a long path loses
    whole middle components (`/work/…/attnviz/data/induction.safetensors`), never part of a
    name, where the terminal would have wrapped it mid-name (--json has it exact)."""
    from attnviz.compute.qkov.circuits import EFFECTIVE_SHARE, RANK_RTOL

    source = printable(result.source, None)
    if width is not None:
        source = elide_at_boundaries(source, width - len(SOURCE_LEAD))
    lines = [Text.assemble((SOURCE_LEAD, "bold"), safe_text(source, "bold"))]
    lines.append(Text(f"conventions: {CONVENTIONS}", style="dim"))
    folded = sorted({layer.norm for layer in result.layers if layer.norm})
    if folded:
        shown = ", ".join(folded[:2]) + (f", … ({len(folded)} norms)" if len(folded) > 2 else "")
        lines.append(safe_text(f"folded: {shown}", "dim"))
    lines.append(Text(f"rank: singular values above {RANK_RTOL:g} × the largest; eff.: fewest "
                      f"holding {EFFECTIVE_SHARE:.0%} of Σσ²; computed in factored form "
                      f"(d × d cores), never E × E", style="dim"))
    shown_notes = result.notes[:6]
    lines += [safe_text(f"note: {note}", "yellow") for note in shown_notes]
    if len(result.notes) > len(shown_notes):
        lines.append(Text(f"({len(result.notes) - len(shown_notes)} more notes in --json)",
                          style="dim"))
    return Group(*lines)


def _values(values: tuple[float, ...]) -> str:
    return " ".join(f"{v:.2g}" for v in values[:SHOWN_SINGULAR])


def heads_table(layers: list[LayerCircuits]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    for name, justify in (("layer", "left"), ("head", "right"), ("kv", "right"),
                          ("‖W_QK‖", "right"), ("r/eff", "right"), ("top σ", "left"),
                          ("‖W_OV‖", "right"), ("r/eff", "right"), ("top σ", "left"),
                          ("copy", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for layer in layers:
        for c in layer.heads:
            table.add_row(safe_text(layer.label), str(c.head), str(c.kv_head),
                          f"{c.qk.norm:.3g}", f"{c.qk.rank}/{c.qk.effective_rank}",
                          _values(c.qk.singular_values), f"{c.ov.norm:.3g}",
                          f"{c.ov.rank}/{c.ov.effective_rank}", _values(c.ov.singular_values),
                          "–" if c.copying is None else f"{c.copying:+.2f}")
    return table


def bias_line(layers: list[LayerCircuits]) -> Text | None:
    """Biases, apart from the circuits: the largest per-head norms, the rest in --json."""
    found = {k: max((c.bias_norms[k] for layer in layers for c in layer.heads
                     if k in c.bias_norms), default=None) for k in "qkv"}
    outs = [layer.out_bias_norm for layer in layers if layer.out_bias_norm is not None]
    parts = [f"‖b_{k}‖ ≤ {v:.3g}" for k, v in found.items() if v is not None]
    parts += [f"‖b_o‖ ≤ {max(outs):.3g}"] if outs else []
    if not parts:
        return None
    return Text("biases (not part of the circuits; per head in --json): " + ", ".join(parts),
                style="dim")


def grid_table(result: CircuitsResult, grid: CompositionGrid) -> RenderableType:
    later, earlier = result.layers[grid.later], result.layers[grid.earlier]
    flat = [b for row in grid.baseline for b in row]
    base = sum(flat) / len(flat) if flat else 0.0
    title = safe_text(f"{grid.kind}: layer {later.label} (rows) on layer {earlier.label} "
                      f"(columns), random baseline {base:.3f}", "bold")
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("", no_wrap=True)
    for j in range(len(grid.scores[0]) if grid.scores else 0):
        table.add_column(f"h{j}", justify="right", no_wrap=True)
    for i, row in enumerate(grid.scores):
        cells = []
        for j, score in enumerate(row):
            above = score > grid.baseline[i][j]
            cells.append(Text(f"{score:.3f}{'*' if above else ' '}",
                              style="bold green" if above else "dim"))
        table.add_row(f"h{i}", *cells)
    return Group(title, table)


def print_circuits(console: Console, result: CircuitsResult) -> None:
    console.print(header(result, console.width))
    console.print()
    console.print(heads_table(result.layers))
    console.print(Text(COPYING_LINE, style="dim"))
    biases = bias_line(result.layers)
    if biases is not None:
        console.print(biases)
    if not result.compositions:
        if result.composition_skipped:
            console.print(safe_text(f"composition: {result.composition_skipped}", "dim"))
        return
    for kind in ("K", "Q", "V"):
        grids = result.grids(kind)
        if not grids:
            continue
        console.print()
        console.print(Text(KIND_TEXT[kind], style="bold"))
        for grid in grids[:MAX_GRIDS]:
            console.print(grid_table(result, grid))
        if len(grids) > MAX_GRIDS:
            console.print(Text(f"… {len(grids) - MAX_GRIDS} more layer pairs: see --json or "
                               "--out", style="dim"))
    console.print(Text("* above the baseline: the mean score of random matrices of the same "
                       "shapes and ranks (seeded, 5 draws)", style="dim"))
    strongest_lines(console, result)


def strongest_lines(console: Console, result: CircuitsResult) -> None:
    """Each later head's strongest composition (by score over baseline), for the first 16."""
    lines = []
    later = sorted({g.later for g in result.compositions})
    for index in later:
        for head in range(result.layers[index].num_heads):
            found = result.strongest(index, head)
            if found is None:
                continue
            kind, earlier, j, score, base = found
            # a zero baseline (a rank-0 circuit) has no ratio, but the line is still shown
            ratio = f"{score / base:.1f}× " if base > 0 else ""
            lines.append(f"  {result.layers[index].label}.{head}: {kind} with "
                         f"{result.layers[earlier].label}.{j}  {score:.3f} "
                         f"({ratio}baseline {base:.3f})")
    if lines:
        console.print()
        console.print(Text("strongest composition of each head (layer.head)", style="bold"))
        for line in lines[:16]:
            console.print(safe_text(line))
        if len(lines) > 16:
            console.print(Text(f"  … {len(lines) - 16} more in --json", style="dim"))
