"""`attnviz compare --html`: an offline page (no script, no network) with a tab per view: the
weights' layers × heads grid (byte-identical, or the head's relative distance ‖B − A‖ / ‖A‖),
and with a corpus one layers × heads grid per statistic of each head's difference B − A with
its 95 % interval. The tabs switch with CSS's :target alone, as `attnviz corpus --html`'s page
does (its style is reused). Every text from the user, the corpus or a model is escaped; each
number cell also carries the full number in data- attributes (repr of the float, as --json
holds it) so a reader or a test can take it back exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnviz.render.corpus_html import STYLE, esc

if TYPE_CHECKING:
    from attnviz.compute.comparison.compare_result import CompareResult, CorpusComparison
    from attnviz.compute.comparison.head_weights import WeightComparison

# the corpus page's style, plus: identical heads greyed, intervals that exclude 0 in red
COMPARE_STYLE = STYLE + "td.same{color:#999}td.moved{font-weight:bold}"
DEFAULT_TAB = "weights"  # the section shown when no tab is targeted: last in the document


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def _data(value: float | None) -> str:
    """A number as a data- attribute value: Python's repr (round-trips), empty for None."""
    return "" if value is None else repr(float(value))


def compare_page(result: CompareResult, corpus_name: str | None = None) -> str:
    """The page; `corpus_name`: the corpus as the user named it, shown with a corpus run."""
    title = f"{result.source_a} against {result.source_b}"
    corpus = result.corpus
    tabs = [(DEFAULT_TAB, "weights")]
    sections: list[str] = []
    if corpus is not None:
        for name in corpus.statistics:
            tabs.append((_tab(name), name))
            sections.append(_statistic(corpus, name))
    sections.append(_weights(result.weights))  # the default tab comes last (see STYLE)
    style = COMPARE_STYLE.replace("#types", f"#{DEFAULT_TAB}")
    nav = "".join(f"<a href='#{tab}'>{esc(name)}</a>" for tab, name in tabs)
    subtitle = ("the weights alone" if corpus is None else
                f"over {corpus.counts.used} examples of {corpus_name or 'the corpus'} run through "
                "both models")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{style}</style></head><body><h2>{esc(title)}</h2>"
            f"<p>model A: <b>{esc(result.source_a)}</b>, model B: <b>{esc(result.source_b)}"
            f"</b>; {esc(subtitle)}</p><nav>{nav}</nav>{''.join(sections)}"
            + "".join(f"<p><small>note: {esc(n)}</small></p>" for n in result.notes)
            + "</body></html>")


def _tab(statistic: str) -> str:
    """A statistic's section id: its name with anything but letters, digits and _ dropped."""
    return "s-" + "".join(c for c in statistic if c.isascii() and (c.isalnum() or c == "_"))


def _grid(rows: list[tuple[str, list[str]]]) -> str:
    heads = max((len(cells) for _, cells in rows), default=0)
    header = "<tr><th>layer</th>" + "".join(f"<th>{h}</th>" for h in range(heads)) + "</tr>"
    body = "".join(f"<tr><th>{esc(label)}</th>{''.join(cells)}</tr>" for label, cells in rows)
    return f"<table>{header}{body}</table>"


def _weights(weights: WeightComparison) -> str:
    rows = []
    for layer in weights.layers:
        cells = []
        for h in layer.heads:
            common = (f"data-layer='{layer.index}' data-head='{h.head}' "
                      f"data-identical='{str(h.identical).lower()}' "
                      f"data-distance='{_data(h.distance)}' title='kv head {h.kv_head}'")
            cells.append(f"<td class='same' {common}>=</td>" if h.identical else
                         f"<td class='moved' {common}>{_num(h.distance)}</td>")
        rows.append((f"{layer.index} {layer.name_a}", cells))
    count = len(weights.heads)
    return (f"<section id='{DEFAULT_TAB}'><h3>weights</h3><p>{len(weights.identical_heads)} of "
            f"{count} heads byte-identical ({esc(', '.join(dict.fromkeys(weights.dtypes)))}); "
            "'=': identical, else the head's relative distance ‖B − A‖ / ‖A‖ over its slices "
            "of W_q, W_k, W_v, W_o</p>"
            f"{_grid(rows)}</section>")


def _statistic(corpus: CorpusComparison, name: str) -> str:
    by_layer: dict[int, list[dict[str, Any]]] = {}
    for row in corpus.head_rows():  # the --json rows: the page shows exactly those numbers
        by_layer.setdefault(row["layer"], []).append(row)
    rows = []
    for info in corpus.layers:
        cells = []
        for row in by_layer.get(info.index, []):
            diff, low, high = (row[f"{name}_{k}"] for k in ("diff", "low", "high"))
            beyond = low is not None and high is not None and (low > 0 or high < 0)
            span = "" if low is None or high is None else \
                f"<br><small>{_num(low)} – {_num(high)}</small>"
            cells.append(
                f"<td class='{'u' if beyond else ''}' data-layer='{info.index}' "
                f"data-head='{row['head']}' data-diff='{_data(diff)}' data-low='{_data(low)}' "
                f"data-high='{_data(high)}' title='A {_num(row[f'{name}_a'])}, B "
                f"{_num(row[f'{name}_b'])}, {row[f'{name}_examples']} examples'>"
                f"{_num(diff)}{span}</td>")
        rows.append((info.label, cells))
    return (f"<section id='{_tab(name)}'><h3>{esc(name)}</h3><p>each head's difference B − A "
            f"of its {esc(name)} over the corpus, under it the "
            f"{corpus.difference.level:.0%} ({esc(corpus.difference.method)}) interval over "
            "examples; red: the interval excludes 0</p>"
            f"{_grid(rows)}</section>")
