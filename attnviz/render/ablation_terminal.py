"""The causal head scorecard in the terminal: a layers × heads grid per measure, each cell the
change removing that head makes, with each head's pattern type beside it for comparison."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.compute.measures.ablation_measures import CAUSAL_LOSS, AblationReport
from attnviz.compute.measures.stats import HeadStats
from attnviz.errors import with_options
from attnviz.render.maps_terminal import colour_off, ramp

MEASURES = (("hidden_change", "hidden change: mean ‖h′−h‖/‖h‖ of the final hidden states"),
            ("loss_change", ""), ("repeat_loss_change",
                                  "repeat loss change: the same over tokens that repeat an "
                                  "earlier token (what induction predicts)"))


def _loss_meaning(report: AblationReport) -> str:
    if report.loss_kind == CAUSAL_LOSS:
        base = "undefined" if report.base_loss is None else f"{report.base_loss:.3f}"
        return (f"loss change: mean next-token loss (nats) with the head removed minus without "
                f"({base})")
    return "loss change: mean KL divergence (nats) of the output distributions"


UNDEFINED = "n/a"  # a measure this input does not define (the reason printed below it)


def _cell(value: float | None, field: str, undefined: bool) -> str:
    if value is None or not math.isfinite(value):
        return UNDEFINED if undefined or value is not None else "–"
    return f"{value:.3f}" if field == "hidden_change" else f"{value:+.3f}"


def scorecard_table(report: AblationReport, field: str, colour: bool) -> Table:
    layers: dict[tuple[int, str], dict[int, float | None]] = {}
    for effect in report.effects:
        layers.setdefault((effect.layer, effect.label), {})[effect.head] = \
            getattr(effect, field)
    heads = sorted({h for row in layers.values() for h in row})
    top = max((abs(v) for row in layers.values() for v in row.values()
               if v is not None and math.isfinite(v)), default=0.0)
    undefined = field in report.undefined
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("layer", justify="right", style="dim")
    for head in heads:
        table.add_column(str(head), justify="right")
    for (_, label), row in layers.items():
        cells = []
        for head in heads:
            value = row.get(head)
            text = _cell(value, field, undefined)
            style = ramp(abs(value) / top) if colour and value is not None and \
                math.isfinite(value) and top > 0 else ""
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
        # an all-undefined grid is shown as such (n/a, with the reason) where the run has the
        # measure at all; a repeat loss without repeated tokens stays silent, as before
        shown_undefined = field == "loss_change" and field in report.undefined
        if all(v is None for v in values) and not shown_undefined:
            continue
        console.print(Text(meaning or _loss_meaning(report), style="dim"), overflow="fold")
        console.print(scorecard_table(report, field, colour))
        if field in report.undefined and any(v is None for v in values):
            console.print(Text(f"{UNDEFINED}: {report.undefined[field]}", style="dim"),
                          overflow="fold")
    top = report.ranked()[:3]
    types = {(s.layer, s.head): s.label or "–" for s in stats}
    # a numbered layer reads L3.1; a named one (an encoder-decoder's 'enc 1') enc 1.1
    ranked = ", ".join(f"{'L' * e.label.isdigit()}{e.label}.{e.head} "
                       f"({types.get((e.layer, e.head), '–')})"
                       for e in top) or UNDEFINED
    fallback = f" ({report.fallback})" if report.fallback else ""
    console.print(Text(f"largest effect{fallback}: {ranked}; pattern ranking (--rank) and "
                       "causal ranking can disagree: a head matters by what it writes, not by "
                       "where it looks", style="dim"), overflow="fold")
    for note in report.notes:  # the terminal is the CLI's: option references as their flags
        shown = with_options(note, lambda name: "--" + name.replace("_", "-"))
        console.print(Text(f"note: {shown}", style="dim"), overflow="fold")
