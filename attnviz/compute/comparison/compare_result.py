"""What `attnviz compare` found: the weight comparison, and with a corpus each head's paired
difference per statistic (`CorpusComparison`), with the --json document and the CSV's rows.
Built by `attnviz.app.compare`, drawn by `attnviz.render.compare_*`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnviz.compute.comparison.head_weights import WeightComparison
    from attnviz.compute.comparison.paired import PairedDifference
    from attnviz.compute.corpus.corpus_examples import LayerInfo
    from attnviz.compute.corpus.corpus_summary import CorpusSummary


@dataclass
class PairCounts:
    """What happened to the examples, summed over the ranks."""

    read: int = 0
    used: int = 0  # run through both models
    truncated: int = 0  # cut to max_tokens in either model
    skipped: int = 0  # empty, or too long with long=skip, in either model
    batches: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class CorpusComparison:
    """Each head's difference per statistic over the corpus: `difference` is (L, H, S) over
    `layers` × heads × STATISTICS; `summaries` are each model's own corpus summary."""

    layers: list[LayerInfo]
    statistics: tuple[str, ...]
    difference: PairedDifference
    summaries: tuple[CorpusSummary, CorpusSummary]
    counts: PairCounts
    world: int = 1
    seconds: float = 0.0  # not in --json: the same run gives the same document

    def head_rows(self) -> list[dict[str, Any]]:
        """One row per head: each statistic's A, B, B − A and interval."""
        d = self.difference
        types = [{(h.layer, h.head): h.type for h in s.heads} for s in self.summaries]
        rows = []
        for l, info in enumerate(self.layers):  # noqa: E741
            for h in range(info.heads):
                row: dict[str, Any] = {"layer": info.index, "layer_label": info.label,
                                       "head": h, "type_a": types[0].get((info.index, h), ""),
                                       "type_b": types[1].get((info.index, h), "")}
                for s, name in enumerate(self.statistics):
                    row |= {f"{name}_a": _num(d.mean_a[l, h, s]),
                            f"{name}_b": _num(d.mean_b[l, h, s]),
                            f"{name}_diff": _num(d.diff[l, h, s]),
                            f"{name}_low": _num(d.low[l, h, s]),
                            f"{name}_high": _num(d.high[l, h, s]),
                            f"{name}_examples": int(d.examples[l, h, s])}
                rows.append(row)
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"examples": self.counts.used, "counts": self.counts.to_json(),
                "world_size": self.world,
                "interval": f"{self.difference.level:.0%} ({self.difference.method})",
                "difference": "against − model",
                "layers": [info.to_json() for info in self.layers],
                "heads": self.head_rows()}


def _num(value: Any) -> float | None:
    number = float(value)
    return number if number == number else None  # NaN (no examples): null


@dataclass(frozen=True)
class CompareResult:
    source_a: str
    source_b: str
    weights: WeightComparison
    corpus: CorpusComparison | None = None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"model": self.source_a, "against": self.source_b,
                               "weights": self.weights.to_json()}
        if self.corpus is not None:
            doc["corpus"] = self.corpus.to_json()
        doc["notes"] = list(self.notes)
        return doc

    def rows(self) -> list[dict[str, Any]]:
        """The CSV: one row per head, its weight comparison and (with a corpus) each
        statistic's A, B, difference and interval."""
        weights = {(h.layer, h.head): h for h in self.weights.heads}
        if self.corpus is None:
            return [{"layer": h.layer, "head": h.head, "kv_head": h.kv_head,
                     "weights_identical": h.identical, "weights_distance": h.distance}
                    for h in weights.values()]
        rows = []
        # the corpus run numbers layers as the forward calls them, the weights as the
        # inventory lists them: paired by position only for one stack of layers (labels 0, 1,
        # …) of the same count; an encoder-decoder's rows leave the weight columns empty
        inventory = sorted({layer for layer, _ in weights})
        by_position = len(inventory) == len(self.corpus.layers) and all(
            info.label == str(i) for i, info in enumerate(self.corpus.layers))
        for row in self.corpus.head_rows():
            position = next(i for i, info in enumerate(self.corpus.layers)
                            if info.index == row["layer"])
            head = weights.get((inventory[position], row["head"])) if by_position else None
            rows.append({"layer": row["layer"], "layer_label": row["layer_label"],
                         "head": row["head"],
                         "weights_identical": None if head is None else head.identical,
                         "weights_distance": None if head is None else head.distance,
                         **{k: v for k, v in row.items()
                            if k not in ("layer", "layer_label", "head")}})
        return rows
