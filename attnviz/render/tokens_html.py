"""`attnviz tokens --html`: an offline page (no network, no external file) with the route view of
each sentence: tokens × layers as nodes, an edge (k, j) → (k + 1, i) as thick as the share of the
output's attribution that passes along it, v_{k+1}[i] · C_k[i, j] (C: the method's per-layer
matrix, v: its chain), for the method chosen; a click on an input token keeps only the routes
leaving it. Beside it, each method's values per token and its correlation with erasure.

Every text from the user or a file reaches the page escaped: tokens and the source are
HTML-escaped where they are markup, and the data block is JSON with `<`, `>` and `&` escaped
as \\u003c, \\u003e, \\u0026, so no string can end the script element."""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from attnviz.errors import printable

if TYPE_CHECKING:
    from attnviz.compute.tokenflow.token_result import SentenceTokens, TokensResult

MAX_TOKENS_DRAWN = 64  # route views wider than this draw the tokens nearest the output
MIN_EDGE_SHARE = 0.005  # edges carrying less than this share of the output are left out


def esc(text: str) -> str:
    return html.escape(printable(text, None))


def _edges(s: SentenceTokens, method: Any, shown: list[int]) -> list[list[float]]:
    """[layer, from token, to token, share] for each edge carrying ≥ MIN_EDGE_SHARE."""
    chain, matrices = s.chains[method], s.matrices[method]
    keep = set(shown)
    out = []
    for k, M in enumerate(matrices):
        flow = chain[k + 1][:, None] * M  # (L, L): v_{k+1}[i] · C_k[i, j]
        for i, j in (flow >= MIN_EDGE_SHARE).nonzero().tolist():
            if i in keep and j in keep:
                out.append([k, j, i, round(float(flow[i, j]), 5)])
    return out


def _routed(result: TokensResult) -> list[Any]:
    """The methods with a route: every one but flow, which is computed for the inputs only."""
    return [m for m in result.methods if str(m) != "flow"]


def _document(result: TokensResult) -> dict[str, Any]:
    sentences = []
    for s in result.sentences:
        L = len(s.tokens)
        last = s.reached(result.causal)
        first = max(0, last - MAX_TOKENS_DRAWN)
        shown = list(range(first, min(L, first + MAX_TOKENS_DRAWN)))
        sentences.append({
            "tokens": [printable(s.tokens[j], None) for j in shown],
            "index": shown, "position": s.position if s.output_is_input else -1,
            "layers": len(s.layers),
            "scores": {str(m): [round(float(s.chains[m][0][j]), 5) for j in shown]
                       for m in result.methods},
            "edges": {str(m): _edges(s, m, shown) for m in _routed(result)},
            "effects": None if s.effects is None else
            [None if s.effects[j] != s.effects[j] else round(float(s.effects[j]), 5)
             for j in shown],
            "correlations": {str(m): c for m, c in s.correlations.items()},
        })
    return {"methods": [str(m) for m in _routed(result)], "sentences": sentences,
            "measure": result.measure, "erased": result.erased_how}


_SCRIPT = """
const data = JSON.parse(document.getElementById('data').textContent);
const svgNS = 'http://www.w3.org/2000/svg';
let method = data.methods[0], followed = null;
function draw(n) {
  const s = data.sentences[n], box = document.getElementById('route' + n);
  box.replaceChildren();
  const dx = 46, dy = 70, L = s.tokens.length, H = s.layers;
  const svg = document.createElementNS(svgNS, 'svg');
  svg.setAttribute('width', dx * L + 40); svg.setAttribute('height', dy * H + 90);
  const x = j => 30 + dx * s.index.indexOf(j), y = k => dy * (H - k) + 20;
  const edges = s.edges[method] || [];
  let reach = null;
  if (followed !== null) {
    reach = new Set([0 + ':' + followed]);
    for (let k = 0; k < H; k++) for (const e of edges)
      if (e[0] === k && reach.has(k + ':' + e[1])) reach.add((k + 1) + ':' + e[2]);
  }
  const top = Math.max(1e-9, ...edges.map(e => e[3]));
  for (const e of edges) {
    const on = reach === null ||
      (reach.has(e[0] + ':' + e[1]) && reach.has((e[0] + 1) + ':' + e[2]));
    const line = document.createElementNS(svgNS, 'line');
    line.setAttribute('x1', x(e[1])); line.setAttribute('y1', y(e[0]));
    line.setAttribute('x2', x(e[2])); line.setAttribute('y2', y(e[0] + 1));
    line.setAttribute('stroke', on ? '#3b528b' : '#ddd');
    line.setAttribute('stroke-width', 0.5 + 7 * e[3] / top);
    line.setAttribute('class', 'edge');
    line.appendChild(document.createElementNS(svgNS, 'title')).textContent =
      'layer ' + e[0] + ': ' + s.tokens[s.index.indexOf(e[1])] + ' → ' +
      s.tokens[s.index.indexOf(e[2])] + ' ' + e[3];
    svg.appendChild(line);
  }
  for (let k = 0; k <= H; k++) for (const j of s.index) {
    const c = document.createElementNS(svgNS, 'circle');
    c.setAttribute('cx', x(j)); c.setAttribute('cy', y(k)); c.setAttribute('r', 4);
    c.setAttribute('fill', k === H && j === s.position ? '#fde725' : '#21918c');
    svg.appendChild(c);
  }
  s.index.forEach((j, a) => {
    const t = document.createElementNS(svgNS, 'text');
    t.setAttribute('x', x(j)); t.setAttribute('y', y(0) + 18);
    t.setAttribute('text-anchor', 'end');
    t.setAttribute('transform', 'rotate(-45 ' + x(j) + ' ' + (y(0) + 18) + ')');
    t.setAttribute('class', 'token' + (followed === j ? ' followed' : ''));
    t.textContent = s.tokens[a];
    t.addEventListener('click', () => { followed = followed === j ? null : j; drawAll(); });
    svg.appendChild(t);
  });
  box.appendChild(svg);
}
function drawAll() { data.sentences.forEach((_, n) => draw(n)); }
document.getElementById('method').addEventListener('change', e => {
  method = e.target.value; drawAll(); });
window.attnvizTokens = {data, follow: j => { followed = j; drawAll(); }};
drawAll();
"""

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; }
.token { cursor: pointer; font-size: 12px; } .followed { font-weight: bold; fill: #b5367a; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: right; }
td.name { text-align: left; } small { color: #555; }
"""


def _table(result: TokensResult, s: SentenceTokens) -> str:
    head = "".join(f"<th>{esc(str(m))}</th>" for m in result.methods)
    head += "<th>erasure</th>" if s.effects is not None else ""
    rows = []
    for j in range(min(s.reached(result.causal), 4 * MAX_TOKENS_DRAWN)):
        cells = "".join(f"<td>{float(s.chains[m][0][j]):.3f}</td>" for m in result.methods)
        if s.effects is not None:
            value = float(s.effects[j])
            cells += f"<td>{value:.3f}</td>" if value == value else "<td>–</td>"
        rows.append(f"<tr><td>{j}</td><td class='name'>{esc(s.tokens[j])}</td>{cells}</tr>")
    rho = "; ".join(f"{esc(str(m))} {'n/a' if c is None else f'{c:+.2f}'}"
                    for m, c in s.correlations.items())
    return (f"<table><tr><th>#</th><th>token</th>{head}</tr>{''.join(rows)}</table>"
            + (f"<p>agreement with erasure (Spearman ρ): {rho}</p>" if rho else ""))


def tokens_page(result: TokensResult) -> str:
    data = json.dumps(_document(result), allow_nan=False).replace("<", "\\u003c") \
        .replace(">", "\\u003e").replace("&", "\\u0026")
    options = "".join(f"<option value='{esc(str(m))}'>{esc(str(m))}</option>"
                      for m in _routed(result))
    parts = []
    for n, s in enumerate(result.sentences):
        parts.append(f"<h2>sentence {n + 1}: output {esc(s.output_name())}</h2>"
                     f"<div id='route{n}'></div>{_table(result, s)}")
    about = "" if result.measure is None else \
        f"<p><small>erasure: each token {esc(result.erased_how or '')}; effect = " \
        f"{esc(result.measure)}</small></p>"
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
            "script-src 'unsafe-inline'; style-src 'unsafe-inline'\">"
            f"<title>attnviz tokens</title><style>{_STYLE}</style></head><body>"
            f"<h1>which input tokens reach the output</h1><p>{esc(result.source)}</p>"
            f"<p>route of <select id='method'>{options}</select> — edges as thick as the share "
            "of the output passing along them; click an input token to follow it (again to "
            f"clear)</p>{about}{''.join(parts)}"
            f"<script type='application/json' id='data'>{data}</script>"
            f"<script>{_SCRIPT}</script></body></html>")
