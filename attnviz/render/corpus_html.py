"""`attnviz corpus --html`: an offline page (no script, no network) with three tabs: the
layers × heads grid of types and their stability, every head's statistics with their 95 %
intervals, and the settle curve (inline SVG). Every text from the user, the corpus or the
model is escaped."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from attnviz.compute.corpus.corpus_sums import STATISTICS
from attnviz.errors import printable

if TYPE_CHECKING:
    from attnviz.compute.corpus.corpus_result import CorpusResult

STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
nav a{margin-right:1em}section{display:none}section:target{display:block}
#types{display:block}section:target~#types{display:none}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:right}th{background:#f4f4f4}td.t{text-align:left}.u{color:#b00}small{color:#666}"""


def esc(text: object) -> str:
    return html.escape(printable(str(text), None))


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def corpus_page(result: CorpusResult) -> str:
    summary = result.summary
    title = f"{result.source} over {summary.examples} examples of {result.corpus}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body><h2>{esc(title)}</h2>"
            "<nav><a href='#types'>types</a><a href='#statistics'>statistics</a>"
            "<a href='#settle'>settle curve</a></nav>"
            f"{_statistics(result)}{_settle(result)}{_types(result)}"
            + "".join(f"<p><small>note: {esc(n)}</small></p>" for n in result.notes)
            + "</body></html>")


def _types(result: CorpusResult) -> str:
    rows: dict[str, list[str]] = {}
    heads = 0
    for head in result.summary.heads:
        cls = " class='t u'" if head.stability < 0.9 else " class='t'"
        rows.setdefault(head.label, []).append(
            f"<td{cls} title='settled after {esc(head.settled_at)} examples'>"
            f"{esc(head.type or 'none')} {head.stability:.0%}</td>")
        heads = max(heads, len(rows[head.label]))
    header = "<tr><th>layer</th>" + "".join(f"<th>{h}</th>" for h in range(heads)) + "</tr>"
    body = "".join(f"<tr><th>{esc(label)}</th>{''.join(cells)}</tr>"
                   for label, cells in rows.items())
    return (f"<section id='types'><h3>head types</h3><p>each head's type over the corpus and the"
            f" share of {result.summary.resamples} bootstrap resamples (examples drawn with "
            "replacement) that give it; red: below 90%</p>"
            f"<table>{header}{body}</table></section>")


def _statistics(result: CorpusResult) -> str:
    header = "<tr><th>layer</th><th>head</th><th>type</th>" + "".join(
        f"<th>{esc(name)}</th>" for name in STATISTICS) + "</tr>"
    rows = []
    for head in result.summary.heads:
        cells = []
        for name in STATISTICS:
            s = head.statistics[name]
            span = "" if s.low is None or s.high is None else \
                f"<br><small>{_num(s.low)} – {_num(s.high)}</small>"
            cells.append(f"<td title='{s.queries} queries in {s.examples} examples'>"
                         f"{_num(s.mean)}{span}</td>")
        rows.append(f"<tr><th>{esc(head.label)}</th><td>{head.head}</td>"
                    f"<td class='t'>{esc(head.type)}</td>{''.join(cells)}</tr>")
    return ("<section id='statistics'><h3>statistics</h3><p>mean over the corpus's queries, "
            "under it the 95% interval treating examples as the unit</p>"
            f"<table>{header}{''.join(rows)}</table></section>")


def _settle(result: CorpusResult) -> str:
    curve = result.summary.settle_curve()
    if not curve:
        return "<section id='settle'><p>no examples</p></section>"
    import math

    width, height, pad = 480, 240, 36
    top = math.log(max(k for k, _ in curve) + 1)

    def x(k: int) -> float:
        return pad + (width - 2 * pad) * math.log(k + 1) / top if top else pad

    def y(share: float) -> float:
        return height - pad - (height - 2 * pad) * share

    points = " ".join(f"{x(k):.1f},{y(s):.1f}" for k, s in curve)
    step = max(1, len(curve) // 8)
    labels = "".join(f"<text x='{x(k):.1f}' y='{height - pad + 14}' font-size='10' "
                     f"text-anchor='middle'>{k}</text>" for k, _ in curve[::step])
    return ("<section id='settle'><h3>settle curve</h3><p>share of heads whose type after the "
            "first k examples is already their final type</p>"
            f"<svg width='{width}' height='{height}' role='img'>"
            f"<polyline fill='none' stroke='#36c' stroke-width='2' points='{points}'/>"
            f"<line x1='{pad}' y1='{y(0)}' x2='{width - pad}' y2='{y(0)}' stroke='#999'/>"
            f"<line x1='{pad}' y1='{y(1)}' x2='{width - pad}' y2='{y(1)}' stroke='#ddd'/>"
            f"<text x='4' y='{y(1) + 4}' font-size='10'>100%</text>"
            f"<text x='4' y='{y(0) + 4}' font-size='10'>0%</text>{labels}</svg></section>")
