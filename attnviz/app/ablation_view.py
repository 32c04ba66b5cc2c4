"""The scorecard beside the pattern views: an --overview of causal effects, and a --rank row."""

from __future__ import annotations

from attnviz.compute.measures.ablation_measures import MEANINGS, AblationReport, defined
from attnviz.compute.measures.overview import Overview, build_overview
from attnviz.compute.measures.ranking import HeadRanking, RankedHead
from attnviz.compute.measures.stats import HeadStats
from attnviz.errors import UsageError, option


def ablation_overview(head_stats: list[HeadStats], report: AblationReport | None) -> Overview:
    """Layers × heads, each cell the head's causal effect (the loss change or KL with an LM
    head, else the hidden change; "–" where undefined)."""
    if report is None:
        raise UsageError(f"{option('overview')} ablation shows the scorecard of {option('ablate')}",
                         fix=f"add {option('ablate')}, or choose another {option('overview')}",
                         option="overview")

    # the key reads "the LM loss (or KL) with an LM head, else the hidden states": an undefined
    # loss change is shown undefined ("–"), not replaced by the hidden change under that key
    field = "hidden_change" if report.loss_kind is None else "loss_change"

    def effect_of(stats: HeadStats) -> float | None:
        effect = report.effect(stats.layer, stats.head)
        return None if effect is None else defined(getattr(effect, field))

    return build_overview(head_stats, "ablation", effect_of)


def causal_ranking(report: AblationReport, top: int) -> HeadRanking:
    """The heads whose removal changes the output most; heads whose measure is undefined are
    not ranked, and a loss change undefined for every head falls back to the hidden change,
    saying so."""
    meaning = MEANINGS[report.measure]
    if report.fallback is not None:
        meaning = f"{meaning} ({report.fallback})"
    return HeadRanking("causal (ablation)", report.measure, meaning,
                       [RankedHead(e.layer, e.head, score) for e in report.ranked()[:top]
                        if (score := report.score(e)) is not None])
