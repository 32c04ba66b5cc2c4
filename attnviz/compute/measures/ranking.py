"""A ranking of a model's heads by type: for each known pattern, the heads that show it most
(as TransformerLens's `detect_head` scores heads), from the statistics of
`attnviz.compute.measures.stats`.

Scores are the statistics themselves (mean weight on the pattern's tokens per query, or entropy
in nats for broad heads), so a ranking reads like the statistics table, sorted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # stats imports torch; the CLI reads HEAD_TYPES before torch's import
    from attnviz.compute.measures.stats import HeadStats

# type name → (statistic, what a high score means)
HEAD_TYPES: dict[str, tuple[str, str]] = {
    "previous-token": ("previous", "weight on the token before the query"),
    "first-token": ("first", "weight on token 0 ([CLS], <s>, or the first word)"),
    "last-token": ("last", "weight on the final token ([SEP], </s>, or the last word)"),
    "special-token": ("special", "weight on special tokens ([CLS], [SEP], <s>, …)"),
    "self": ("self", "weight on the query's own token"),
    "duplicate-token": ("duplicate", "weight on earlier copies of the query's token"),
    "induction": ("induction", "weight on the token after an earlier copy of the query's"),
    "next-token": ("next", "weight on the token after the query"),
    "punctuation": ("punctuation", "weight on punctuation (. , ; : ! ?)"),
    "broad": ("entropy", "entropy in nats: attention spread over many tokens"),
}
DEFAULT_TOP = 3


@dataclass(frozen=True)
class RankedHead:
    layer: int
    head: int
    score: float


@dataclass(frozen=True)
class HeadRanking:
    head_type: str
    statistic: str
    meaning: str
    heads: list[RankedHead]  # best first; empty when no input exercised the pattern

    def to_json(self) -> dict[str, object]:
        return {"type": self.head_type, "statistic": self.statistic, "meaning": self.meaning,
                "heads": [{"layer": h.layer, "head": h.head, "score": h.score}
                          for h in self.heads]}


def rank_heads(stats: list[HeadStats], top: int = DEFAULT_TOP) -> list[HeadRanking]:
    """For each head type, the `top` heads with the highest score (ties: lower layer, head);
    a head whose statistic is undefined (None or NaN) is never ranked."""
    rankings = []
    for head_type, (statistic, meaning) in HEAD_TYPES.items():
        scored = [(value, s) for s in stats
                  if (value := getattr(s, statistic)) is not None and math.isfinite(value)]
        scored.sort(key=lambda item: (-item[0], item[1].layer, item[1].head))
        rankings.append(HeadRanking(head_type, statistic, meaning,
                                    [RankedHead(s.layer, s.head, value)
                                     for value, s in scored[:top]]))
    return rankings
