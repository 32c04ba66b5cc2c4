"""Terminal output for `split` (rich renderables)."""

from __future__ import annotations

import colorsys
from typing import TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnviz.compute.splitting.split import ProjectionSplit, Proof, SplitReport
from attnviz.compute.splitting.split_views import BandPicture
from attnviz.errors import elide_at_boundaries, printable
from attnviz.render.elide import MAX_TABLE_ROWS, elided, gap_note
from attnviz.render.safe import safe_text

if TYPE_CHECKING:
    from attnviz.sources.hf.split_proof_result import ProofResult
    from attnviz.sources.hf.verify import VerifyResult

PROJECTION_TITLES = {"q": "W_q", "k": "W_k", "v": "W_v", "o": "W_o"}
LABEL_WIDTH = 14  # "h12 96:104 │ "
BAND_SHADES = "░▒▓█"  # without colour: a quarter of the largest mean |w| each


def head_rgb(head: int, num_heads: int) -> tuple[int, int, int]:
    """A distinct hue per head; neighbours alternate across the wheel so bands stand apart."""
    order = (head * 7) % max(num_heads, 1) if num_heads % 7 else head
    r, g, b = colorsys.hsv_to_rgb(order / max(num_heads, 1), 0.75, 1.0)
    return int(r * 255), int(g * 255), int(b * 255)


def hex_color(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def summary(report: SplitReport, source: str, width: int = 100) -> Text:
    """Source, layer, geometry and storage lines, for a terminal `width` columns wide."""
    layer = report.layer
    text = Text()
    text.append("source  ", style="bold")
    # one line: a long path loses whole middle components, never a part of a name (a path
    # printed whole would wrap mid-name; --json has it exact)
    text.append(f"{elide_at_boundaries(printable(source, None), width - 8)}\n")
    if layer.name:
        text.append("layer   ", style="bold")
        text.append(printable(f"{layer.name} ({layer.family})", None) + "\n")
    text.append("geometry  ", style="bold")
    text.append(f"E = {layer.embed_dim}, H = {layer.num_heads}, d = {layer.head_dim}")
    if layer.num_kv_heads != layer.num_heads:
        text.append(f", H_kv = {layer.num_kv_heads}")
    if layer.kdim != layer.embed_dim or layer.vdim != layer.embed_dim:
        text.append(f", kdim = {layer.kdim}, vdim = {layer.vdim}")
    text.append(f"\nstorage   {printable(layer.storage, None)}")
    return text


def projection_title(proj: ProjectionSplit, prefix: str = "") -> Text:
    text = Text()
    text.append(f"{PROJECTION_TITLES[proj.name]} {fmt_shape(proj.shape)}", style="bold")
    text.append(f" · split by {proj.split} · stored at "
                f"{printable(_relative(proj.stored_at, prefix), None)}")
    return text


def _relative(stored_at: str, prefix: str) -> str:
    """Drop the layer's own prefix: it is printed once above the tables."""
    return stored_at[len(prefix) + 1:] if prefix and stored_at.startswith(prefix + ".") \
        else stored_at


def projection_table(proj: ProjectionSplit, num_heads: int, prefix: str = "") -> Table:
    axis = "rows" if proj.split == "rows" else "cols"
    table = Table(show_edge=False, pad_edge=False, caption_justify="left")
    is_kv = proj.name in ("k", "v")
    table.add_column("kv head" if is_kv and any(h.query_heads for h in proj.heads) else "head",
                     justify="right")
    table.add_column(axis, justify="right")
    table.add_column("slice shape", justify="right")
    table.add_column("stored at", overflow="fold")
    if any(h.query_heads for h in proj.heads):
        table.add_column("used by query heads")
    for i in elided(len(proj.heads)):
        if i is None:
            table.add_row(*["…"] * len(table.columns))
            table.caption = gap_note(len(proj.heads), MAX_TABLE_ROWS)
            continue
        h = proj.heads[i]
        color = hex_color(head_rgb(h.head, num_heads))
        cells: list[Text | str] = [Text(str(h.head), style=f"bold {color}"),
                                   f"{h.start}:{h.stop}", fmt_shape(h.shape),
                                   safe_text(_relative(h.stored_at, prefix))]
        if h.query_heads:
            cells.append(_span(h.query_heads))
        table.add_row(*cells)
    return table


def _span(heads: tuple[int, ...]) -> str:
    if heads == tuple(range(heads[0], heads[-1] + 1)) and len(heads) > 2:
        return f"{heads[0]}–{heads[-1]}"
    return ", ".join(map(str, heads))


def band_view(picture: BandPicture, num_heads: int, embed_dim: int,
              shades: bool = False) -> Group:
    """W_q as head bands: colour = head, brightness = mean |weight| of the block; without colour
    (`shades`) a shade glyph per quarter of the largest mean |w| (░ ▒ ▓ █) carries it instead."""
    reading = ("shade = mean |w|: ░ < 25% ≤ ▒ < 50% ≤ ▓ < 75% ≤ █ of the largest" if shades
               else "brightness = mean |w|")
    lines: list[RenderableType] = [Text(
        f"W_q rows (grouped by head) × {embed_dim} input features, "
        f"{len(picture.col_blocks)} columns of {_block_label(picture.col_blocks)} features each; "
        + reading, style="dim")]
    previous = None
    for line in picture.lines:
        label = f"h{line.head} {line.head_rows[0]}:{line.head_rows[1]}" \
            if line.head != previous else ""
        previous = line.head
        # The label alone is dim: a dim base style would dim every cell of the line.
        text = Text()
        text.append(f"{label:>{LABEL_WIDTH - 2}} │", style="dim")
        r, g, b = head_rgb(line.head, num_heads)
        for value in line.cells:
            value = min(max(value, 0.0), 1.0)
            if shades:
                text.append(BAND_SHADES[min(len(BAND_SHADES) - 1, int(value * len(BAND_SHADES)))])
                continue
            level = 0.2 + 0.8 * value
            text.append("█", style=hex_color((int(r * level), int(g * level), int(b * level))))
        lines.append(text)
    shown = len({line.head for line in picture.lines})
    if num_heads > shown:
        lines.append(Text(gap_note(num_heads, shown, "heads", "the --out figure draws all of "
                                   "W_q"), style="dim"))
    return Group(*lines)


def _block_label(blocks: list[tuple[int, int]]) -> str:
    sizes = sorted({stop - start for start, stop in blocks})
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]}"


def proof_line(proof: Proof) -> Text:
    ok = proof.passed
    text = Text()
    text.append("proof  ", style="bold")
    text.append(f"{proof.reference.split(' (')[0]} vs. head by head from the slices, on a "
                f"random batch (B={proof.batch}, L={proof.length}, seed {proof.seed}, one "
                "padded key):\n")
    text.append(f"  max |Δ output| = {proof.output_diff:.1e}   "
                f"max |Δ weights| = {proof.weights_diff:.1e}   "
                f"(tolerance {proof.tolerance:.0e})\n  ")
    text.append("✓ equal to float32 round-off" if ok else "✗ FAILED: above the tolerance",
                style="bold green" if ok else "bold red")
    return text


def print_split(console: Console, report: SplitReport, picture: BandPicture | None,
                explanation: list[str], source: str) -> None:
    layer = report.layer
    assert layer.num_heads is not None
    console.print(summary(report, source, console.width))
    for proj in report.projections.values():
        console.print()
        console.print(projection_title(proj, layer.name))
        console.print(projection_table(proj, layer.num_heads, layer.name))
    if picture is not None:
        console.print()
        shades = console.color_system is None or console.no_color
        console.print(band_view(picture, layer.num_heads, layer.embed_dim, shades))
    console.print()
    for sentence in explanation:
        console.print(safe_text("• " + sentence))
    for note in report.notes:
        console.print(safe_text("note: " + note, style="yellow"))
    if report.proof is not None:
        console.print()
        console.print(proof_line(report.proof))


def verify_lines(result: VerifyResult, sentences: list[str]) -> Text:
    """The model check of `split --model --verify`."""
    text = Text()
    text.append("verify ", style="bold")
    text.append(f"recompute proof: layer {result.label or result.layer_index}'s attention "
                f"recomputed by attnviz from its per-head W_q/W_k slices "
                f"({printable(result.positions, None)}) on the block's captured input, against "
                f"the model's own weights, for {len(sentences)} sentences:\n")
    worst = ", ".join(f"{d:.1e}" for d in result.per_head)
    text.append(f"  max |Δ| per head: {worst}\n  max |Δ| = {result.max_diff:.1e}   (tolerance "
                f"{result.tolerance:.0e})\n  ")
    text.append("✓ the model's heads are these slices" if result.passed else "✗ FAILED",
                style="bold green" if result.passed else "bold red")
    for note in result.notes:
        text.append(f"\n  note: {printable(note, None)}", style="yellow")
    return text


def proof_lines(result: ProofResult, recompute_skipped: str | None) -> Text:
    """The split proof of `split --model --verify`, one line per perturbation (named so in the
    output and the JSON: "ablation" names `attnviz ablate`'s causal scorecard only)."""
    text = Text()
    text.append("verify ", style="bold")
    text.append(f"split proof, through the model's own forward pass (layer {result.label}, "
                f"{result.module}, {result.sentences} sentences): the rows attnviz assigns to "
                "each head negated in turn in the model's own parameters; only that head may "
                f"change (unchanged: ≤ {result.unchanged:.0e}, changed: > {result.changed:.0e})\n")
    names = {"q": "W_q head", "k": "W_k kv  ", "v": "W_v kv  "}
    prefix = result.layer.name
    for check in result.checks:
        heads = ", ".join(map(str, check.expected))
        what = f"head{'s' if len(check.expected) > 1 else ''} {heads}"
        if check.projection == "v":
            what = f"W_o input of {what}"
        mark = {"pass": "✓", "fail": "✗", "untestable": "?"}[check.status]
        text.append(f"  {mark} {names[check.projection]} {check.head:<3} "
                    f"{_relative(check.rows, prefix):<24} changed {what} by "
                    f"{'≥ ' if len(check.expected) > 1 else ''}{check.own:.1e}, others ≤ "
                    f"{check.others:.1e}",
                    style="" if check.status == "pass" else
                    "bold red" if check.status == "fail" else "yellow")
        if check.reason:
            text.append(f"  ({check.reason})", style="bold red" if check.status == "fail"
                        else "yellow")
        text.append("\n")
    untestable = len(result.untestable)
    if result.passed:
        text.append(f"  ✓ every head's rows are where attnviz says ({len(result.checks)} "
                    f"perturbations" + (f", {untestable} untestable" if untestable else "")
                    + ")", style="bold green")
    else:
        text.append(f"  ✗ FAILED: {len(result.failures)} of {len(result.checks)} perturbations",
                    style="bold red")
    for note in result.notes:
        text.append(f"\n  note: {note}", style="yellow")
    if recompute_skipped is not None:
        text.append(f"\n  recompute proof not run: {recompute_skipped}", style="dim")
    return text
