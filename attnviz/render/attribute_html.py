"""The `attribute --html` page: per prompt the sum line and the layers × heads grid (and the
cross-attention's, and clean − corrupted), each cell coloured by its signed value with its
exact value on hover; offline, no script."""

from __future__ import annotations

from attnviz.compute.logit.attribute_result import CONVENTIONS, AttributeResult, Parts
from attnviz.render.logit_html_style import diverging, esc, page


def attribute_page(result: AttributeResult) -> str:
    body = [f"<h2>direct logit attribution of {esc(result.model)}</h2>",
            f"<p>metric: {esc(result.metric)}; final norm: {esc(result.norm)}, its scale "
            f"frozen at each run's own final residual; logit transform: "
            f"{esc(result.transform)}</p>"]
    body += [f"<p class=\"dim\">{esc(line)}</p>" for line in CONVENTIONS]
    body += [f"<p class=\"dim\">note: {esc(note)}</p>" for note in result.notes]
    for prompt in result.prompts:
        wrong = "" if prompt.wrong is None else f" − logit({prompt.wrong[1]!r})"
        body += [f"<h3>{esc(prompt.prompt)}</h3>",
                 f"<p>position {prompt.position} ({esc(repr(prompt.tokens[prompt.position]))})"
                 f": logit({esc(repr(prompt.answer[1]))}){esc(wrong)}; final norm 1/σ = "
                 f"{prompt.scale:.6g}</p>", _sum(prompt.parts), *_grids(prompt.parts)]
        if prompt.difference is not None and prompt.corrupt is not None:
            body += [f"<h4>clean − corrupted ({esc(prompt.corrupt.prompt)})</h4>",
                     *_grids(prompt.difference)]
    return page("attnviz attribute", body)


def _sum(parts: Parts) -> str:
    return (f"<p>sum of parts {parts.total:+.6f}; the model's own metric {parts.target:+.6f}; "
            f"remainder {parts.remainder:+.2e}</p>")


def _grids(parts: Parts) -> list[str]:
    found = [_grid("heads", parts.heads, parts.attn_bias, parts.attn, parts.mlp, "H")]
    if parts.cross is not None:
        found.append(_grid("cross-attention", parts.cross_heads, parts.cross_bias, parts.cross,
                           None, "X"))
    found.append(f"<p class=\"dim\">embeddings {parts.embed:+.4f}; final norm bias "
                 f"{parts.norm_bias:+.4f}; unembedding bias {parts.head_bias:+.4f}</p>")
    return found


def _grid(title: str, heads: list[list[float]] | None, bias: list[float] | None,
          totals: list[float], mlp: list[float] | None, letter: str) -> str:
    rows = heads or [[] for _ in totals]
    width = max((len(r) for r in rows), default=0)
    bound = max([abs(v) for r in rows for v in r] + [abs(v) for v in totals] + [1e-12])
    head = "".join(f"<th>{letter}{h}</th>" for h in range(width))
    lines = [f"<table><caption class=\"dim\">{esc(title)}</caption><tr><th>layer</th>{head}"
             "<th>W_O b</th><th>total</th><th>MLP</th></tr>"]
    for layer, total in enumerate(totals):
        cells = "".join(f"<td style=\"background:{diverging(v, bound)}\" "
                        f"title=\"L{layer}{letter}{h}: {v:+.6g}\">{v:+.3f}</td>"
                        for h, v in enumerate(rows[layer]))
        b = "–" if bias is None else f"{bias[layer]:+.3f}"
        m = "–" if mlp is None else f"{mlp[layer]:+.3f}"
        lines.append(f"<tr><td class=\"l\">L{layer}</td>{cells}<td>{b}</td><td>{total:+.3f}"
                     f"</td><td>{m}</td></tr>")
    return "".join(lines) + "</table>"
