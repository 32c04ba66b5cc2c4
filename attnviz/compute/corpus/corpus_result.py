"""The result of a corpus run (`attnviz.app.corpus.run_corpus`): the float64 sums, the layers
they cover, what happened to the examples, and the summary the sums give (computed once, on
first use): what every renderer and the JSON, CSV and API read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnviz.compute.corpus.corpus_examples import LayerInfo
from attnviz.compute.corpus.corpus_summary import CorpusSummary, summarize_sums
from attnviz.compute.corpus.corpus_sums import STATISTICS, CorpusSums

DEFAULT_MAX_TOKENS = 128


@dataclass
class Counts:
    """What happened to the examples, summed over the ranks."""

    read: int = 0  # examples read (ordinals)
    used: int = 0
    truncated: int = 0
    skipped_long: int = 0
    skipped_empty: int = 0  # no token at all
    batches: int = 0
    padding: int = 0  # padded positions the batches carried (bucketing keeps this small)

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class CorpusResult:
    source: str
    corpus: str
    weighting: str
    sums: CorpusSums
    layers: list[LayerInfo]
    counts: Counts
    world: int = 1
    seconds: float = 0.0
    resumed_from: int = 0  # examples a resumed run found done
    seed: int = 0  # the sample's and the bootstrap's
    long: str = "truncate"  # what was done to examples longer than max_tokens
    max_tokens: int = DEFAULT_MAX_TOKENS
    notes: list[str] = field(default_factory=list)
    _summary: CorpusSummary | None = field(default=None, repr=False)

    @property
    def summary(self) -> CorpusSummary:
        if self._summary is None:
            self._summary = summarize_sums(self.sums, self.layers, self.counts.read)
        return self._summary

    def to_json(self) -> dict[str, Any]:
        """The --json document. It holds no wall time: the same corpus, model and options give
        the same document (a resumed run's and an uninterrupted one's compare equal)."""
        summary = self.summary
        return {"source": self.source, "corpus": self.corpus, "weighting": self.weighting,
                "examples": summary.examples, "tokens": summary.tokens,
                "counts": self.counts.to_json(), "world_size": self.world,
                "resumed_from": self.resumed_from,
                "resamples": summary.resamples, "seed": self.seed,
                "long": self.long, "max_tokens": self.max_tokens,
                "interval": "95% (per-example variance)",
                "layers": [info.to_json() for info in self.layers],
                "heads": [head.to_json() for head in summary.heads],
                "settle_curve": [{"examples": k, "settled_share": share}
                                 for k, share in summary.settle_curve()],
                "notes": list(self.notes)}

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per head (the CSV): type, stability, and each statistic's mean,
        interval and query count."""
        out = []
        for head in self.summary.heads:
            row: dict[str, Any] = {"layer": head.layer, "layer_label": head.label,
                                   "head": head.head, "type": head.type,
                                   "stability": head.stability, "settled_at": head.settled_at}
            for name in STATISTICS:
                s = head.statistics[name]
                row |= {name: s.mean, f"{name}_low": s.low, f"{name}_high": s.high,
                        f"{name}_queries": s.queries}
            out.append(row)
        return out
