"""The `lens --html` page: per prompt the layers × positions grid, each cell its top token on
a background by the answer's probability, the top tokens and the answer's rank on hover;
offline, no script."""

from __future__ import annotations

from attnviz.compute.logit.lens_result import LensResult, PromptLens
from attnviz.render.logit_html_style import esc, page, sequential


def lens_page(result: LensResult) -> str:
    body = [f"<h2>logit lens of {esc(result.model)}</h2>",
            f"<p>each row: the residual after that layer through the final norm "
            f"({esc(result.norm)}; each row's own statistics) and the unembedding; logit "
            f"transform: {esc(result.transform)}. Cell: the top token; background: the "
            "answer's probability; hover: the top tokens and the answer's rank.</p>"]
    body += [f"<p class=\"dim\">note: {esc(note)}</p>" for note in result.notes]
    body += [_prompt(p) for p in result.prompts]
    return page("attnviz lens", body)


def _prompt(prompt: PromptLens) -> str:
    answer = "" if prompt.answer is None else f"; answer {prompt.answer[1]!r}"
    head = "".join(f"<th>{p}<br>{esc(prompt.tokens[p])}</th>" for p in prompt.positions)
    lines = [f"<h3>{esc(prompt.prompt)}{esc(answer)}</h3><table><tr><th></th>{head}</tr>"]
    for name, row in zip(prompt.rows, prompt.cells, strict=True):
        cells = []
        for cell in row:
            tops = ", ".join(f"{t!r} {p:.3f}" for t, p in cell.top)
            rank = "" if cell.answer_rank is None else \
                f"; answer #{cell.answer_rank}, p = {cell.answer_prob:.3g}"
            shade = sequential(cell.answer_prob or 0.0)
            cells.append(f"<td class=\"l\" style=\"background:{shade}\" "
                         f"title=\"{esc(tops + rank)}\">{esc(cell.top[0][0])}</td>")
        lines.append(f"<tr><th>{esc(name)}</th>{''.join(cells)}</tr>")
    return "".join(lines) + "</table>"
