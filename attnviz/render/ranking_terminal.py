"""The head ranking in the terminal: one line per head type, its best heads with scores."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.compute.measures.ranking import HeadRanking


def ranking_table(rankings: list[HeadRanking]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("type", no_wrap=True)
    table.add_column("top heads (layer.head score)", no_wrap=True)
    for ranking in rankings:
        heads = "  ".join(f"L{h.layer}.{h.head} {h.score:.2f}" for h in ranking.heads) or "–"
        table.add_row(Text(ranking.head_type, style="bold"), heads)
    return table


def print_ranking(console: Console, rankings: list[HeadRanking]) -> None:
    console.print(Text("heads ranked by type (score = the statistic above; broad = entropy)",
                       style="bold"))
    console.print(ranking_table(rankings))
    if any(not ranking.heads for ranking in rankings):
        console.print(Text("– : no query in the input exercised the pattern (induction and "
                           "duplicate need repeated tokens: try --probe induction)",
                           style="dim"))
