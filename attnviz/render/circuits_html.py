"""`attnviz.circuits(...)` in a notebook: the per-head table and each head's strongest
composition as plain HTML (every text escaped)."""

from __future__ import annotations

import html

from attnviz.compute.qkov.circuits_result import COPYING_LINE, CircuitsResult
from attnviz.errors import printable


def esc(text: str) -> str:
    """HTML-escaped, and first escaped as the terminal escapes it (U+202E, ESC, …)."""
    return html.escape(printable(text, None))


def circuits_html(result: CircuitsResult) -> str:
    rows = []
    for layer in result.layers:
        for c in layer.heads:
            copying = "–" if c.copying is None else f"{c.copying:+.2f}"
            rows.append(f"<tr><td>{esc(layer.label)}</td><td>{c.head}</td><td>{c.kv_head}</td>"
                        f"<td>{c.qk.norm:.3g}</td><td>{c.qk.rank}/{c.qk.effective_rank}</td>"
                        f"<td>{c.ov.norm:.3g}</td><td>{c.ov.rank}/{c.ov.effective_rank}</td>"
                        f"<td>{copying}</td></tr>")
    head = ("<tr><th>layer</th><th>head</th><th>kv</th><th>‖W_QK‖</th><th>rank/eff</th>"
            "<th>‖W_OV‖</th><th>rank/eff</th><th>copy</th></tr>")
    parts = [f"<b>circuits of {esc(result.source)}</b>",
             f"<table>{head}{''.join(rows)}</table>", f"<small>{esc(COPYING_LINE)}</small>"]
    lines = []
    for index in sorted({g.later for g in result.compositions}):
        for h in range(result.layers[index].num_heads):
            found = result.strongest(index, h)
            if found is not None:
                kind, earlier, j, score, base = found
                lines.append(f"{esc(result.layers[index].label)}.{h}: {kind} with "
                             f"{esc(result.layers[earlier].label)}.{j} {score:.3f} "
                             f"(baseline {base:.3f})")
    if lines:
        parts.append("<b>strongest composition of each head</b><br>" + "<br>".join(lines[:64]))
    for note in result.notes:
        parts.append(f"<small>note: {esc(note)}</small>")
    return "<div>" + "<br>".join(parts) + "</div>"
