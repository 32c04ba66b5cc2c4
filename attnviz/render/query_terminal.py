"""--query in the terminal: one query token's per-head slices, products, scores and weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.errors import printable

if TYPE_CHECKING:
    from attnviz.compute.measures.breakdown import QueryBreakdown


def _vector(values: list[float], shown: int = 4) -> str:
    head = ", ".join(f"{v:+.2f}" for v in values[:shown])
    return f"[{head}{', …' if len(values) > shown else ''}]"


def print_query(console: Console, breakdown: QueryBreakdown, key_labels: list[str]) -> None:
    """One query token's per-head slices: q_h, each key's k_h, products, scores, weights."""
    b = breakdown
    captured = getattr(b, "source", "slices") == "captured"
    layer = getattr(b, "layer_label", None) or b.layer
    console.print(Text(f"query {b.query} {b.token!r} of sentence {b.sentence + 1}, layer "
                       f"{layer}: each head works on its own d = {len(b.heads[0].q)} features "
                       f"of the projected query and key (scale {b.scale:.4g})", style="bold"))
    if captured:
        console.print(Text(f"q_h and k_h: {b.positions}; score = scale · q_h·k_h"
                           + (f", then {b.added}" if b.added else "")
                           + ", then the model's mask and softmax", style="dim"))
    elif b.positions != "none":
        console.print(Text(f"positions: {b.positions}; q_h and k_h below are after it",
                           style="dim"))
    for h in b.heads:
        console.print()
        projected = f"x_{b.query} · W_q[{h.q_rows[0]}:{h.q_rows[1]}]ᵀ (+ b)"
        if captured:
            projected = f"query head {h.head} of the model's attention at token {b.query}"
        elif b.positions.startswith("RoPE"):
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
    console.print(Text(f"recomputed from the {'captured q_h and k_h' if captured else 'slices'}; "
                       f"max |Δ| against the maps above: {b.max_diff:.1e}", style="dim"))
