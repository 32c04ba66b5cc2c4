"""The causal head scorecard in the terminal: a layers × heads grid per measure, each cell the
change removing that head makes, with each head's pattern type beside it for comparison."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.compute.ablation_measures import CAUSAL_LOSS, AblationReport
from attnviz.compute.stats import HeadStats
from attnviz.render.maps_terminal import colour_off, ramp

MEASURES = (("hidden_change", "hidden change: mean ‖h′−h‖/‖h‖ of the final hidden states"),
            ("loss_change", ""), ("repeat_loss_change",
                                  "repeat loss change: the same over tokens that repeat an "
                                  "earlier token (what induction predicts)"))


def _loss_meaning(report: AblationReport) -> str:
    if report.loss_kind == CAUSAL_LOSS:
        return (f"loss change: mean next-token loss (nats) with the head removed minus without "
                f"({report.base_loss:.3f})")
    return "loss change: mean KL divergence (nats) of the output distributions"


def scorecard_table(report: AblationReport, field: str, colour: bool) -> Table:
    layers: dict[tuple[int, str], dict[int, float | None]] = {}
    for effect in report.effects:
        layers.setdefault((effect.layer, effect.label), {})[effect.head] = \
            getattr(effect, field)
    heads = sorted({h for row in layers.values() for h in row})
    top = max((abs(v) for row in layers.values() for v in row.values() if v is not None),
              default=0.0)
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("layer", justify="right", style="dim")
    for head in heads:
        table.add_column(str(head), justify="right")
    for (_, label), row in layers.items():
        cells = []
        for head in heads:
            value = row.get(head)
            text = "–" if value is None else f"{value:+.3f}" if field != "hidden_change" \
                else f"{value:.3f}"
            style = ramp(abs(value) / top) if colour and value is not None and top > 0 else ""
            cells.append(Text(text, style=style))
        table.add_row(label, *cells)
    return table


def print_scorecard(console: Console, report: AblationReport, stats: list[HeadStats]) -> None:
    """Title, one grid per measure the report holds, and what each means."""
    how = "zeroed" if report.mode == "zero" else "replaced by its mean over real tokens"
    console.print(Text(f"causal head scorecard: each head removed (its slice of the W_O input "
                       f"{how}), the model's own forward rerun", style="bold"))
    colour = not colour_off(console)
    for field, meaning in MEASURES:
        values = [getattr(e, field) for e in report.effects]
        if all(v is None for v in values):
            continue
        console.print(Text(meaning or _loss_meaning(report), style="dim"), overflow="fold")
        console.print(scorecard_table(report, field, colour))
    top = sorted(report.effects, key=lambda e: -report.score(e))[:3]
    types = {(s.layer, s.head): s.label or "–" for s in stats}
    console.print(Text("largest effect: " + ", ".join(
        f"L{e.label}.{e.head} ({types.get((e.layer, e.head), '–')})" for e in top)
        + "; pattern ranking (--rank) and causal ranking can disagree: a head matters by what "
        "it writes, not by where it looks", style="dim"), overflow="fold")
    for note in report.notes:
        console.print(Text(f"note: {note}", style="dim"), overflow="fold")
