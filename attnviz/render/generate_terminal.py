"""`attnviz generate` in the terminal: each sentence's generated text, and per generated token
the tokens its row attends to most (computed in attnviz.app.generate, drawn here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from attnviz.render.safe import safe_text as plain

if TYPE_CHECKING:
    from rich.console import Console

    from attnviz.sources.generate_spec import Focus, Generation


def print_generation(out: Console, generation: Generation, focus: list[Focus]) -> None:
    """The generated text per sentence, then a table of each generated token's top keys."""
    spec = generation.spec
    how = (f"sampled (temperature {spec.temperature:g}, top-p {spec.top_p:g}, seed {spec.seed})"
           if spec.sample else "greedy")
    out.print(plain(f"generated  {how}, up to {spec.max_new} tokens per sentence (how: the "
                    "generation note above)"))
    for b, text in enumerate(generation.texts, 1):
        count = len(generation.generated_ids[b - 1])
        line = Text(f"sentence {b} (+{count} token{'s' if count != 1 else ''}): ")
        line.append(plain(" ".join(generation.generated_tokens[b - 1]), style="bold"))
        out.print(line, overflow="fold")
        if text.strip() and text != " ".join(generation.generated_tokens[b - 1]):
            out.print(plain(f"  decoded: {text}"), overflow="fold")
    if not focus:
        out.print()
        return
    first = focus[0]
    head = "mean over heads" if first.head is None else f"head {first.head}"
    table = Table(title=plain(f"what each generated token attends to (layer {first.layer}, "
                              f"{head}; its row when fed back in)"), title_justify="left",
                  show_edge=False, pad_edge=False)
    table.add_column("sent", justify="right")
    table.add_column("row", justify="right")
    table.add_column("token")
    table.add_column("attends to (position: token weight)")
    for item in focus:
        keys = "  ".join(f"{p}:{token} {weight:.2f}" for p, token, weight in item.top)
        table.add_row(str(item.sentence + 1), str(item.row), plain(item.token), plain(keys))
    out.print(table)
    out.print()


def print_ranked_focus(out: Console, picked: list[tuple[list[str], list[Focus]]]) -> None:
    """What the heads --rank puts first attend to from each generated token: one row per
    generated token, one column per head (its types, layer and head above), the key each
    head weighs most (--json lists more)."""
    picked = [(types, items) for types, items in picked if items]
    if not picked:
        return
    table = Table(title=plain("the key the heads --rank puts first weigh most from each "
                              "generated token (their rows when fed back in)"),
                  title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("sent", justify="right")
    table.add_column("token")
    for types, items in picked:
        table.add_column(plain(f"L{items[0].layer}.{items[0].head} ({', '.join(types)})"),
                         overflow="fold")
    for i, first in enumerate(picked[0][1]):
        cells = ["{}:{} {:.2f}".format(*items[i].top[0]) for _, items in picked]
        table.add_row(str(first.sentence + 1), plain(first.token), *(plain(c) for c in cells))
    out.print(table)
