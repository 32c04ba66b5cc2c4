"""The layers × heads overview of a run: for each head its type — the pattern it follows, named
as `compute.measures.ranking` names head types — or one of its statistics, from the head statistics
the
run computed (no second forward pass).

A head's type: the pattern `HeadStats.label` names (previous, first, last, self, duplicate,
induction, next, punctuation: the strongest one taking ≥ LABEL_THRESHOLD of its attention, over
at least MIN_LABEL_QUERIES queries that exercised it); else special-token when
the special tokens together take that much ([CLS] and [SEP] shared); else broad when no key
takes that much of a query's weight on average (mean max weight below it); else other (sharp,
but on keys no listed pattern explains).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnviz.compute.measures.ranking import HEAD_TYPES
from attnviz.core.choices import OverviewShows

if TYPE_CHECKING:  # stats imports torch: not needed to name its type
    from attnviz.compute.measures.stats import HeadStats

BROAD = "broad"
OTHER = "other"
SPECIAL = "special-token"
# --overview choice → (HeadStats field, what a cell's number means)
STATISTICS: dict[str, tuple[str, str]] = {
    "entropy": ("entropy", "entropy in nats (higher: spread over more keys)"),
    "max": ("max_weight", "mean largest weight of a query"),
    "distance": ("distance", "mean attended distance, in tokens"),
    "first": ("first", HEAD_TYPES["first-token"][1]),
    "previous": ("previous", HEAD_TYPES["previous-token"][1]),
    "last": ("last", HEAD_TYPES["last-token"][1]),
    "special": ("special", HEAD_TYPES["special-token"][1]),
    "self": ("self", HEAD_TYPES["self"][1]),
    "duplicate": ("duplicate", HEAD_TYPES["duplicate-token"][1]),
    "induction": ("induction", HEAD_TYPES["induction"][1]),
    "next": ("next", HEAD_TYPES["next-token"][1]),
    "punctuation": ("punctuation", HEAD_TYPES["punctuation"][1]),
    "ablation": ("ablation", "effect of removing the head (attnviz ablate): change of the LM loss "
                 "(or KL) with an LM head, else of the final hidden states"),
}
LABEL = "label"
OFF = "off"
CHOICES = OverviewShows.values()  # parsed where the CLI and the API take them
assert set(CHOICES) == {LABEL, *STATISTICS, OFF}, "OverviewShows and STATISTICS differ"


@dataclass(frozen=True)
class OverviewCell:
    head: int
    type: str  # a compute.measures.ranking type name, "broad" or "other"
    statistic: str  # the HeadStats field `score` is: the type's own (max_weight for "other")
    score: float | None
    value: float | None = None  # the statistic the overview shows, when it shows one

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"head": self.head, "type": self.type,
                               "statistic": self.statistic, "score": self.score}
        return doc


@dataclass(frozen=True)
class OverviewRow:
    layer: int
    label: str  # as the run labels the layer: "3", "enc 0", "cross 1"
    cells: list[OverviewCell]


@dataclass(frozen=True)
class Overview:
    shows: str  # "label" or a key of STATISTICS
    rows: list[OverviewRow]  # in the order the run computed the layers

    @property
    def statistic(self) -> str | None:
        """The HeadStats field the cells show, or None for types."""
        return STATISTICS[self.shows][0] if self.shows in STATISTICS else None

    @property
    def meaning(self) -> str:
        return STATISTICS[self.shows][1] if self.shows in STATISTICS else "head type"

    def to_json(self) -> dict[str, Any]:
        from attnviz.compute.measures.stats import LABEL_THRESHOLD

        return {"shows": self.shows, "statistic": self.statistic, "meaning": self.meaning,
                "threshold": LABEL_THRESHOLD,
                "rows": [{"layer": row.layer, "label": row.label,
                          "heads": [cell.to_json() | ({} if self.statistic is None
                                                      else {"value": cell.value})
                                    for cell in row.cells]} for row in self.rows]}


def head_type(stats: HeadStats) -> tuple[str, str, float | None]:
    """(type, the HeadStats field behind it, its value) of one head (see the module doc)."""
    from attnviz.compute.measures.stats import LABEL_THRESHOLD

    if stats.label:
        field = HEAD_TYPES[stats.label][0]
        return stats.label, field, getattr(stats, field)
    if stats.special is not None and stats.special >= LABEL_THRESHOLD \
            and stats.exercised("special"):
        return SPECIAL, "special", stats.special
    if stats.max_weight < LABEL_THRESHOLD:
        return BROAD, HEAD_TYPES[BROAD][0], stats.entropy
    return OTHER, "max_weight", stats.max_weight


def build_overview(head_stats: list[HeadStats], shows: str = LABEL,
                   value_of: Callable[[HeadStats], float | None] | None = None) -> Overview:
    """One row per layer (consecutive statistics of one layer), one cell per head; rows in
    the run's order, grouped by stack (enc, dec, cross). A cell's value is the statistic
    `shows` names, or `value_of(stats)` for a measure kept outside the statistics (ablation)."""
    if value_of is None:
        field = STATISTICS[shows][0] if shows in STATISTICS else None
        value_of = (lambda stats: None) if field is None else (  # noqa: E731
            lambda stats: getattr(stats, field))
    rows: list[OverviewRow] = []
    for stats in head_stats:
        label = stats.layer_label or str(stats.layer)
        if not rows or (rows[-1].layer, rows[-1].label) != (stats.layer, label):
            rows.append(OverviewRow(stats.layer, label, []))
        kind, statistic, score = head_type(stats)
        rows[-1].cells.append(OverviewCell(stats.head, kind, statistic, score, value_of(stats)))
    # an encoder-decoder run calls dec N and cross N in turn: rows read by stack instead
    stacks = list(dict.fromkeys(_stack(row.label) for row in rows))
    rows.sort(key=lambda row: stacks.index(_stack(row.label)))
    return Overview(shows, rows)


def _stack(label: str) -> str:
    """'cross' of 'cross 1'; '' for a bare layer number."""
    return label.rpartition(" ")[0]

