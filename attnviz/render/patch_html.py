"""`attnviz patch --html`: one self-contained offline page — the pair, the baselines, and each
grid as a coloured table; clicking a head of a layers × heads grid shows that head's effect at
each position (from the per-position grid of the same direction, where it was computed).

Everything from the user or a file (tokens, the model's name) reaches the page only as escaped
text: the data travels as JSON inside a <script type="application/json"> with <, > and &
escaped, and the script writes it with textContent, never as markup."""

from __future__ import annotations

import html
import json

from attnviz.compute.patching.result import DIRECTIONS, PatchResult

_STYLE = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.4em 0}
td,th{padding:2px 6px;text-align:right;font-variant-numeric:tabular-nums}
th{font-weight:600;color:#555}
td.cell{cursor:pointer;border:1px solid #fff;min-width:3.2em}
td.cell.on{outline:2px solid #000}
.note{color:#666;font-size:12px}
h2{font-size:15px;margin:1.2em 0 .2em}
"""

_SCRIPT = """
const data = JSON.parse(document.getElementById('patch-data').textContent);
function colour(v){
  if (v === null) return '#eee';
  const t = Math.max(-1, Math.min(1, v));
  const r = t < 0 ? 255 : Math.round(255 - 180 * t), b = t > 0 ? 255 : Math.round(255 + 180 * t);
  const g = Math.round(255 - 150 * Math.abs(t));
  return `rgb(${r},${g},${b})`;
}
function el(tag, text, cls){
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function table(grid, onclick){
  const t = el('table'), head = el('tr');
  head.appendChild(el('th', ''));
  grid.cols.forEach(c => head.appendChild(el('th', c)));
  t.appendChild(head);
  grid.rows.forEach((r, i) => {
    const tr = el('tr');
    tr.appendChild(el('th', r));
    grid.cols.forEach((c, j) => {
      const v = grid.mean[i][j];
      const td = el('td', v === null ? 'n/a' : v.toFixed(2), 'cell');
      td.style.background = colour(v);
      td.title = `${r} ${c}: ${v === null ? 'undefined' : v.toFixed(4)}`
        + (grid.spread[i][j] ? ` ± ${grid.spread[i][j].toFixed(4)}` : '')
        + ` (raw ${grid.raw[i][j].toFixed(4)})`;
      td.dataset.cell = r + ' ' + c;
      if (onclick) td.addEventListener('click', () => onclick(r, c, td));
      tr.appendChild(td);
    });
    t.appendChild(tr);
  });
  return t;
}
const root = document.getElementById('grids');
data.grids.forEach(grid => {
  root.appendChild(el('h2', grid.title));
  root.appendChild(el('div', 'direction: ' + grid.direction_explained, 'note'));
  const detail = el('div', undefined, 'detail');
  const positions = data.grids.find(g => g.site === 'head-positions'
                                       && g.direction === grid.direction);
  let click = null;
  if (grid.site === 'heads' && positions) {
    click = (r, c, td) => {
      root.querySelectorAll('td.on').forEach(x => x.classList.remove('on'));
      td.classList.add('on');
      const i = positions.rows.indexOf(r + c);
      detail.replaceChildren(el('div', `${r}${c} at each position:`, 'note'),
        table({rows: [r + c], cols: positions.cols, mean: [positions.mean[i]],
               spread: [positions.spread[i]], raw: [positions.raw[i]]}, null));
    };
  }
  root.appendChild(table(grid, click));
  grid.col_notes.concat(grid.notes).forEach(n => root.appendChild(el('div', n, 'note')));
  root.appendChild(detail);
});
document.body.dataset.ready = '1';
"""


def _json(document: object) -> str:
    """JSON safe inside a <script> element."""
    text = json.dumps(document, ensure_ascii=True, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def patch_html(result: PatchResult) -> str:
    """The page, as one string."""
    doc = result.to_json()
    b = result.baselines
    first = result.pairs[0]
    lines = [
        f"<b>activation patching: {html.escape(result.model)}</b>",
        f"clean: {html.escape(' '.join(first.clean))}",
        f"corrupted: {html.escape(' '.join(first.corrupt))}",
        f"answer: {html.escape(' '.join(first.answer))}"
        + (f", wrong: {html.escape(first.wrong)}" if first.wrong is not None else "")
        + (f" ({len(result.pairs)} pairs; the first shown)" if len(result.pairs) > 1 else ""),
        f"metric: {html.escape(str(result.metric))} = {html.escape(b.explained)}",
        f"baselines: clean {b.clean_mean:.4f}, corrupted {b.corrupt_mean:.4f}; cells: 0 = "
        "corrupted, 1 = clean (click a head for its effect at each position)",
    ]
    notes = "".join(f"<div class=note>{html.escape(n)}</div>" for n in result.notes)
    directions = "".join(f"<div class=note>{html.escape(t)}</div>" for t in DIRECTIONS.values())
    return ("<!doctype html><html><head><meta charset=utf-8><title>attnviz patch</title>"
            f"<style>{_STYLE}</style></head><body>"
            + "".join(f"<div>{line}</div>" for line in lines) + directions
            + "<div id=grids></div>" + notes
            + f"<script type=application/json id=patch-data>{_json(doc)}</script>"
            f"<script>{_SCRIPT}</script></body></html>")
