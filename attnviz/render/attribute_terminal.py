"""`attnviz attribute` in the terminal: per prompt, the metric and the frozen final-norm scale,
the largest parts named, a layers × heads grid (with each layer's W_O bias, attention and MLP
totals), and the sum line — parts, their sum, the model's own metric and the remainder."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnviz.compute.logit.attribute_result import (
    CONVENTIONS,
    AttributeResult,
    Parts,
    PromptAttribution,
)
from attnviz.errors import printable
from attnviz.render.safe import safe_text

MAX_HEAD_COLUMNS = 16  # wider models: the grid shows the first 16 heads, --json has them all
MAX_PROMPTS = 8  # prompts shown one by one; the mean covers them all


def print_attribution(console: Console, result: AttributeResult) -> None:
    console.print(header(result), soft_wrap=True)
    for prompt in result.prompts[:MAX_PROMPTS]:
        console.print()
        console.print(prompt_view(prompt, result), soft_wrap=True)
    if len(result.prompts) > MAX_PROMPTS:
        console.print(Text(f"({len(result.prompts) - MAX_PROMPTS} more prompts in --json)",
                           style="dim"))
    summary = result.mean()
    if summary is not None:
        what = "clean − corrupted" if result.prompts[0].difference is not None else "parts"
        console.print()
        console.print(Group(
            Text(f"mean over {len(result.prompts)} prompts ({what}):", style="bold"),
            _top(summary[0], result.top), _grid(summary[0], summary[1])), soft_wrap=True)


def header(result: AttributeResult) -> RenderableType:
    lines = [Text.assemble(("direct logit attribution of ", "bold"),
                           safe_text(printable(result.model, None), "bold")),
             safe_text(f"metric: {result.metric}"),
             safe_text(f"final norm: {result.norm}, its scale 1/σ frozen at each run's own "
                       "final residual (stated per prompt)"),
             safe_text(f"logit transform after the unembedding: {result.transform}", "dim")]
    lines += [Text(f"convention: {line}", style="dim") for line in CONVENTIONS]
    lines += [safe_text(f"note: {note}", "yellow") for note in result.notes]
    return Group(*lines)


def prompt_view(prompt: PromptAttribution, result: AttributeResult) -> RenderableType:
    token = prompt.tokens[prompt.position]
    wrong = "" if prompt.wrong is None else f" − logit({prompt.wrong[1]!r})"
    lines: list[RenderableType] = [
        safe_text(f"prompt: {prompt.prompt}", "bold"),
        safe_text(f"at position {prompt.position} ({token!r}): logit({prompt.answer[1]!r})"
                  f"{wrong}; final norm 1/σ = {prompt.scale:.6g}"),
        _sum_line(prompt.parts, prompt.model_metric, result.softcapped),
        Text("largest parts:", style="bold"), _top(prompt.parts, result.top),
        _grid(prompt.parts), *_cross(prompt.parts)]
    if prompt.corrupt is not None and prompt.difference is not None:
        c = prompt.corrupt
        lines += [safe_text(f"corrupted: {c.prompt}", "bold"),
                  safe_text(f"at position {c.position} ({c.tokens[c.position]!r}); final norm "
                            f"1/σ = {c.scale:.6g}"),
                  _sum_line(c.parts, c.model_metric, result.softcapped),
                  Text("clean − corrupted, largest:", style="bold"),
                  _top(prompt.difference, result.top), _grid(prompt.difference),
                  *_cross(prompt.difference)]
    return Group(*lines)


def _sum_line(parts: Parts, own: float, softcapped: bool) -> Text:
    what = "the model's own metric before its softcap" if softcapped else \
        "the model's own metric"
    text = (f"sum of parts {parts.total:+.6f}; {what} {parts.target:+.6f}; remainder "
            f"{parts.remainder:+.2e}")
    if softcapped:
        text += f" (after the softcap: {own:+.6f})"
    return Text(text)


def _top(parts: Parts, top: int) -> Table:
    table = Table(box=None, pad_edge=False, show_header=False, padding=(0, 1))
    table.add_column("part", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True, style="dim")
    ranked = parts.largest(top)
    scale = sum(abs(v) for _, v in parts.named()) or 1.0
    for name, value in ranked:
        table.add_row(name, f"{value:+.4f}", f"{abs(value) / scale:.0%} of Σ|part|")
    return table


def _grid(parts: Parts, spread: list[list[float]] | None = None) -> Table:
    """Layers × heads (then W_O bias, attention total, MLP), signed values (± `spread`)."""
    heads = parts.heads or [[] for _ in parts.attn]
    shown = min(MAX_HEAD_COLUMNS, max((len(row) for row in heads), default=0))
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1),
                  caption=f"embeddings {parts.embed:+.3f}; final norm bias "
                  f"{parts.norm_bias:+.3f}; unembedding bias {parts.head_bias:+.3f}"
                  + ("" if shown == max((len(r) for r in heads), default=0) else
                     f"; first {shown} heads shown (--json has all)"),
                  caption_justify="left")
    table.add_column("layer", no_wrap=True)
    for h in range(shown):
        table.add_column(f"H{h}", justify="right", no_wrap=True)
    for name in ("W_O b", "attn", "MLP"):
        table.add_column(name, justify="right", no_wrap=True, style="dim")
    for layer, total in enumerate(parts.attn):
        cells: list[Text | str] = [_cell(v, None if spread is None else spread[layer][h])
                                   for h, v in enumerate(heads[layer][:shown])]
        cells += ["" for _ in range(shown - len(cells))]
        cells.append("–" if parts.attn_bias is None else f"{parts.attn_bias[layer]:+.3f}")
        cells.append(f"{total:+.3f}")
        cells.append("–" if parts.mlp is None else f"{parts.mlp[layer]:+.3f}")
        table.add_row(f"L{layer}", *cells)
    return table


def _cell(value: float, spread: float | None = None) -> Text:
    text = Text(f"{value:+.3f}", style="green" if value > 0 else "red" if value < 0 else "")
    if spread is not None:
        text.append(f"±{spread:.2f}", style="dim")
    return text


def _cross(parts: Parts) -> list[RenderableType]:
    """An encoder-decoder's cross-attention heads (LnXh), layers × heads with W_O's bias."""
    if parts.cross_heads is None or parts.cross is None:
        return []
    shown = min(MAX_HEAD_COLUMNS, len(parts.cross_heads[0]))
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1),
                  title="cross-attention", title_justify="left")
    table.add_column("layer", no_wrap=True)
    for h in range(shown):
        table.add_column(f"X{h}", justify="right", no_wrap=True)
    for name in ("W_O b", "cross"):
        table.add_column(name, justify="right", no_wrap=True, style="dim")
    for layer, total in enumerate(parts.cross):
        bias = "–" if parts.cross_bias is None else f"{parts.cross_bias[layer]:+.3f}"
        table.add_row(f"L{layer}", *[_cell(v) for v in parts.cross_heads[layer][:shown]],
                      bias, f"{total:+.3f}")
    return [table]
