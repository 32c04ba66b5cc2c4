"""`attnviz lens` in the terminal: per prompt a layers × positions grid — each cell the lens's
top token and its probability, and the answer's rank — with a legend, and the top tokens of
the last position named row by row."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnviz.compute.logit.lens_result import LensResult, PromptLens
from attnviz.errors import printable
from attnviz.render.safe import safe_text

TOKEN_WIDTH = 9
CELL_WIDTH = TOKEN_WIDTH + 2  # a column and its padding
ROW_WIDTH = 6  # the row labels' column


def print_lens(console: Console, result: LensResult) -> None:
    console.print(header(result), soft_wrap=True)
    for prompt in result.prompts:
        console.print()
        console.print(prompt_view(prompt, console.width), soft_wrap=True)


def header(result: LensResult) -> RenderableType:
    lines = [Text.assemble(("logit lens of ", "bold"),
                           safe_text(printable(result.model, None), "bold")),
             safe_text(f"each row: the residual after that layer through the final norm "
                       f"({result.norm}; each row's own statistics) and the unembedding; "
                       f"logit transform: {result.transform}"),
             Text("legend: each cell = the top token, then its probability and #n, the "
                  "answer's rank there (#1 = top); rows: emb = the embeddings, Ln = after "
                  "layer n (the last is the model's own output)", style="dim")]
    lines += [safe_text(f"note: {note}", "yellow") for note in result.notes]
    return Group(*lines)


def _short(token: str) -> str:
    token = printable(token, None)
    return token if len(token) <= TOKEN_WIDTH else token[:TOKEN_WIDTH - 1] + "…"


def _row_label(name: str) -> str:
    return "emb" if name == "embeddings" else "L" + name.removeprefix("layer ")


def prompt_view(prompt: PromptLens, width: int = 80) -> RenderableType:
    """The grid of as many of the last positions as `width` columns hold."""
    fits = max(1, (width - ROW_WIDTH) // CELL_WIDTH)
    columns = list(range(len(prompt.positions)))[-fits:]
    answer = "" if prompt.answer is None else f"; answer {prompt.answer[1]!r}"
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("", no_wrap=True, min_width=ROW_WIDTH - 1)
    for c in columns:
        p = prompt.positions[c]
        table.add_column(Text.assemble(str(p), "\n", safe_text(_short(prompt.tokens[p]))),
                         no_wrap=True, max_width=TOKEN_WIDTH)
    for name, row in zip(prompt.rows, prompt.cells, strict=True):
        cells = []
        for c in columns:
            cell = row[c]
            token, prob = cell.top[0]
            text = Text.assemble(safe_text(_short(token)), "\n", _probability(prob))
            if cell.answer_rank is not None:
                text.append(f" #{cell.answer_rank}",
                            style="green" if cell.answer_rank == 1 else "dim")
            cells.append(text)
        table.add_row(_row_label(name), *cells)
    lines: list[RenderableType] = [safe_text(f"prompt: {prompt.prompt}{answer}", "bold"), table]
    if len(columns) < len(prompt.positions):
        lines.append(Text(f"(last {len(columns)} of {len(prompt.positions)} positions shown; "
                          "--json has every one)", style="dim"))
    last = prompt.positions[columns[-1]]
    lines.append(safe_text(f"top tokens at position {last} ({prompt.tokens[last]!r}), "
                           "row by row:", "bold"))
    for name, row in zip(prompt.rows, prompt.cells, strict=True):
        cell = row[columns[-1]]
        tops = ", ".join(f"{printable(t, 20)!r} {p:.3f}" for t, p in cell.top)
        rank = "" if cell.answer_rank is None else \
            f"  (answer #{cell.answer_rank}, p = {cell.answer_prob:.3g})"
        lines.append(safe_text(f"  {name}: {tops}{rank}"))
    return Group(*lines)


def _probability(p: float) -> str:
    """.84, 1.0, <.01: short enough for a cell."""
    return "1.0" if p >= 0.995 else "<.01" if p < 0.005 else f"{p:.2f}".removeprefix("0")
