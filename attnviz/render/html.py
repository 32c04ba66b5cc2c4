"""One self-contained, offline HTML page of a run's attention: head view, model view, query view.

`document_from_run(run, head_stats, breakdown)` (in `attnviz.render.html_document`, which also
describes the document's format) builds a compact JSON-able document;
`render_html(doc)` turns it into ONE HTML file with the data, the script (html_view.js) and the
style sheet (html_view.css) inline. The page makes no network request of any kind: no CDN, no
web font, no URL outside the page (its Content-Security-Policy says `default-src 'none'` and
admits only its own inline script, by hash). `notebook_html(doc)` wraps the page in a sandboxed
`<iframe srcdoc=…>` for Jupyter's `_repr_html_`.

Everything that comes from the user or a file (sentences, tokens, paths, layer names) is data:
the document travels as JSON inside `<script type="application/json">` with `<`, `>`, `&` and `/`
escaped, and the script puts it on the page only as text (textContent, canvas fillText).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from importlib import resources
from typing import Any

# The document side, re-exported: callers (cli, api, tests) import the page's API from here.
from attnviz.errors import printable

HTML_SUFFIXES = (".html", ".htm")


def render_html(doc: dict[str, Any]) -> str:
    """One self-contained HTML page of a document (data and code inline, no network)."""
    doc = page_strings(doc)
    script = _asset("html_view.js") + "\n" + _asset("html_steps.js")
    style = _asset("html_view.css") + "\n" + _asset("html_steps.css")
    lowered = script.lower()
    if any(bad in lowered for bad in ("</script", "<script", "<!--")):
        raise ValueError("html_view.js must not contain script or comment tags")
    if "</style" in style.lower():
        raise ValueError("html_view.css must not contain </style")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    policy = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
              "img-src data:; base-uri 'none'; form-action 'none'")
    title = html.escape(f"attnviz · {doc.get('source', '')}", quote=True)
    return _PAGE.format(policy=policy, title=title, style=style, data=embed_json(doc),
                        script=script)


def notebook_html(doc: dict[str, Any], height: int = 760) -> str:
    """The page inside a sandboxed `<iframe srcdoc=…>`: what a `_repr_html_` returns, inline in
    Jupyter without internet (scripts run; the page cannot reach the notebook)."""
    page = html.escape(render_html(doc), quote=True)
    return (f'<iframe srcdoc="{page}" sandbox="allow-scripts" title="attnviz attention view" '
            f'style="width: 100%; height: {int(height)}px; border: 1px solid #ddd"></iframe>')


def page_strings(value: Any) -> Any:
    """Every string of a document escaped as the terminal escapes it (`errors.printable`):
    control characters, bidi overrides and isolates (U+202E, U+2066), zero-widths (U+200B),
    C1 controls, lone surrogates. JSON's own \\u escapes would hand the raw character back to
    the page's script, which puts text on the page as it is (textContent): a token holding
    U+202E would reverse the sentence selector and the token columns. Escaped here, once, every
    place the page shows text (labels, titles, head names, paths, notes) shows `\\u202e`, as
    the terminal does, and the file holds no such character either."""
    if isinstance(value, str):
        return printable(value, None)
    if isinstance(value, dict):
        return {page_strings(k): page_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [page_strings(v) for v in value]
    return value


def embed_json(doc: dict[str, Any]) -> str:
    """JSON text safe inside a <script> element: no <, >, & or / (so no </script> and no URL
    literal), ASCII only, no NaN or Infinity."""
    text = json.dumps(_finite(doc), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("/", "\\/"))


def _asset(name: str) -> str:
    return resources.files("attnviz.render").joinpath(name).read_text(encoding="utf-8")


def _finite(value: Any) -> Any:
    """NaN and ±Infinity (not JSON) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>
{style}
</style>
</head>
<body>
<header id="top">
  <h1>attnviz</h1>
  <dl id="meta"></dl>
</header>
<nav id="tabs" role="tablist"></nav>
<div id="controls">
  <label id="sentence-control">sentence <select id="sentence-select"></select></label>
  <label id="layer-control">layer <select id="layer-select"></select></label>
  <label id="scale-control"><input type="checkbox" id="own-scale"> colour each map by its own
    maximum</label>
</div>
<main>
  <section id="step-view" class="view" data-title="Generation">
    <p class="help">The text the model wrote after each prompt. Click a generated token (or
      focus one and step with ← →; hover to preview): below, its row, the one computed when the
      token was fed back in to write the next, over every token before it, for the chosen layer
      and head or the mean over heads; then each head's row, and the full map with the
      prompt/generated boundary (red) and the chosen row outlined.</p>
    <div class="step-controls">
      <label>layer <select id="step-layer"></select></label>
      <label>head <select id="step-head"></select></label>
      <button type="button" id="step-prev">← previous</button>
      <button type="button" id="step-next">next →</button>
    </div>
    <div id="step-text" role="group" aria-label="prompt and generated tokens"></div>
    <p id="step-status" class="status" aria-live="polite"></p>
    <div id="step-row" aria-label="the chosen row's weights over its keys"></div>
    <ol id="step-top"></ol>
    <div id="step-figures">
      <figure><canvas id="step-heads" width="400" height="100"></canvas>
        <figcaption>each head's row (rows: heads; columns: keys)</figcaption></figure>
      <figure><canvas id="step-map" width="420" height="420"></canvas>
        <figcaption id="step-map-caption">the full map</figcaption></figure>
    </div>
  </section>
  <section id="head-view" class="view" data-title="Head view">
    <p class="help">Hover over a token, or click it to keep it: lines go to the tokens of the
      other column it attends to (left: queries, right: keys), one colour per head, opacity =
      weight. Toggle heads on the left.</p>
    <div id="hv-wrap">
      <div id="head-toggles"></div>
      <div id="hv-body">
        <div id="hv-left" class="tokcol"></div>
        <canvas id="hv-lines" width="240" height="100"></canvas>
        <div id="hv-right" class="tokcol"></div>
      </div>
    </div>
    <p id="hv-status" class="status"></p>
  </section>
  <section id="model-view" class="view" data-title="Model view">
    <p class="help">Every layer (rows) and head (columns) of the sentence. Click a map to open
      it large; the weight under the cursor is shown below it.</p>
    <div id="mv-grid"></div>
    <div id="mv-detail" hidden>
      <p id="mv-title" class="status"></p>
      <canvas id="mv-large" width="600" height="600"></canvas>
      <p id="mv-readout" class="status"></p>
    </div>
  </section>
  <section id="query-view" class="view" data-title="Query view"></section>
  <section id="stats-view" class="view" data-title="Statistics"></section>
</main>
<footer id="legend"></footer>
<noscript>This page needs JavaScript (it runs offline, from this file alone).</noscript>
<script type="application/json" id="attnviz-data">{data}</script>
<script>{script}</script>
</body>
</html>
"""
