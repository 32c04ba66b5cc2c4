"""The scorecard beside the pattern views: an --overview of causal effects, and a --rank row."""

from __future__ import annotations

from attnviz.compute.ablation_measures import AblationReport
from attnviz.compute.overview import Overview, build_overview
from attnviz.compute.ranking import HeadRanking, RankedHead
from attnviz.compute.stats import HeadStats
from attnviz.errors import UsageError, option


def ablation_overview(head_stats: list[HeadStats], report: AblationReport | None) -> Overview:
    """Layers × heads, each cell the head's causal effect (the report's score)."""
    if report is None:
        raise UsageError(f"{option('overview')} ablation shows the scorecard of {option('ablate')}",
                         fix=f"add {option('ablate')}, or choose another {option('overview')}",
                         option="overview")

    def effect_of(stats: HeadStats) -> float | None:
        effect = report.effect(stats.layer, stats.head)
        return None if effect is None else report.score(effect)

    return build_overview(head_stats, "ablation", effect_of)


def causal_ranking(report: AblationReport, top: int) -> HeadRanking:
    """The heads whose removal changes the output most."""
    ranked = sorted(report.effects, key=lambda e: (-report.score(e), e.layer, e.head))
    meaning = {"loss change": "rise of the next-token loss when the head is removed",
               "KL": "KL divergence of the outputs when the head is removed",
               "hidden change": "relative change of the final hidden states when removed"}
    return HeadRanking("causal (ablation)", report.measure, meaning[report.measure],
                       [RankedHead(e.layer, e.head, report.score(e)) for e in ranked[:top]])
