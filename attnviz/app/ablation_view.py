"""The scorecard beside the pattern views: an --overview of causal effects, and a --rank row."""

from __future__ import annotations

from attnviz.compute.ablation_measures import AblationReport
from attnviz.compute.overview import Overview, OverviewCell, OverviewRow, head_type
from attnviz.compute.ranking import HeadRanking, RankedHead
from attnviz.compute.stats import HeadStats
from attnviz.errors import UsageError


def ablation_overview(head_stats: list[HeadStats], report: AblationReport | None) -> Overview:
    """Layers × heads, each cell the head's causal effect (the report's score)."""
    if report is None:
        raise UsageError("‹overview› ablation shows the scorecard of ‹ablate›",
                         fix="add ‹ablate›, or choose another ‹overview›", option="overview")
    rows: list[OverviewRow] = []
    for stats in head_stats:
        label = stats.layer_label or str(stats.layer)
        if not rows or (rows[-1].layer, rows[-1].label) != (stats.layer, label):
            rows.append(OverviewRow(stats.layer, label, []))
        kind, statistic, score = head_type(stats)
        effect = report.effect(stats.layer, stats.head)
        value = None if effect is None else report.score(effect)
        rows[-1].cells.append(OverviewCell(stats.head, kind, statistic, score, value))
    return Overview("ablation", rows)


def causal_ranking(report: AblationReport, top: int) -> HeadRanking:
    """The heads whose removal changes the output most."""
    ranked = sorted(report.effects, key=lambda e: (-report.score(e), e.layer, e.head))
    meaning = {"loss change": "rise of the next-token loss when the head is removed",
               "KL": "KL divergence of the outputs when the head is removed",
               "hidden change": "relative change of the final hidden states when removed"}
    return HeadRanking("causal (ablation)", report.measure, meaning[report.measure],
                       [RankedHead(e.layer, e.head, report.score(e)) for e in ranked[:top]])
