"""What the sums say per head: each statistic's mean with a 95 % interval that treats examples
as the unit, the head's type with its bootstrap stability, and when that type settled.

The mean of a statistic is the ratio estimator R = Σ s_i / Σ c_i (example i: s_i the sum over
its queries, c_i their number), which is what `attnviz heatmap` reports for all the examples in
one batch. Its standard error treats the examples as independent clusters of queries (the
delta method for a ratio): se² = n / (n - 1) · Σ (s_i - R c_i)² / (Σ c_i)², n the examples that
have the statistic, and Σ (s_i - R c_i)² = Σ s² - 2R Σ sc + R² Σ c². The interval is
R ± 1.96 se (normal; with n < 2 there is none).

A head's type is `compute.measures.overview.head_type` of the means (the same rule as heatmap's
overview). Its stability is the share of the R Poisson-bootstrap resamples whose means give the
same type; the settle curve is the type after the first k examples at each band edge, and a
head settled at the first edge after which it never changed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.corpus.corpus_examples import LayerInfo
from attnviz.compute.corpus.corpus_sums import STATISTICS, CorpusSums, band_edges
from attnviz.compute.measures.overview import head_type
from attnviz.compute.measures.stats import PATTERNS, HeadStats

Z95 = 1.959963984540054  # the normal's 97.5 % quantile


@dataclass(frozen=True)
class Interval:
    """One statistic of one head over the corpus."""

    mean: float | None  # None: no example had a query for it
    low: float | None  # the 95 % interval (None: fewer than 2 examples)
    high: float | None
    queries: int  # queries that exercised it
    examples: int  # examples that had at least one such query

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "low": self.low, "high": self.high,
                "queries": self.queries, "examples": self.examples}


@dataclass(frozen=True)
class CorpusHead:
    layer: int
    label: str  # the layer as the run labels it
    head: int
    statistics: dict[str, Interval]  # by STATISTICS name
    type: str  # compute.measures.overview's head type
    stability: float  # share of bootstrap resamples giving `type`
    settled_at: int | None  # examples after which the type never changed (None: not yet)
    curve: tuple[str, ...]  # the type after each of `CorpusSummary.checkpoints` examples

    def stats(self) -> HeadStats:
        """The head's corpus means as heatmap's HeadStats (queries counted)."""
        return head_stats(self.layer, self.head, {n: s.mean for n, s in self.statistics.items()},
                          {n: s.queries for n, s in self.statistics.items()}, self.label)

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "layer_label": self.label, "head": self.head,
                "type": self.type, "stability": self.stability, "settled_at": self.settled_at,
                "statistics": {n: s.to_json() for n, s in self.statistics.items()}}


@dataclass(frozen=True)
class CorpusSummary:
    layers: list[LayerInfo]
    heads: list[CorpusHead]  # layer by layer, head by head
    examples: int
    tokens: int
    resamples: int
    checkpoints: tuple[int, ...]  # example counts of the settle curve (the last: all)

    def settle_curve(self) -> list[tuple[int, float]]:
        """(examples, share of heads whose type then was their final type)."""
        if not self.heads:
            return []
        return [(k, sum(h.curve[i] == h.type for h in self.heads) / len(self.heads))
                for i, k in enumerate(self.checkpoints)]


def head_stats(layer: int, head: int, means: dict[str, float | None], queries: dict[str, int],
               label: str | None = None) -> HeadStats:
    values = {name: means.get(name) for name in STATISTICS}
    return HeadStats(layer=layer, head=head, layer_label=label,
                     queries=tuple((name, int(queries.get(name, 0)))
                                   for name in (*PATTERNS, "special")),
                     **values)  # type: ignore[arg-type]


def _type_of(layer: int, head: int, total: torch.Tensor, queries: torch.Tensor) -> str:
    """head_type of means total / queries, (S,) each."""
    means = {name: (float(total[s] / queries[s]) if queries[s] > 0 else None)
             for s, name in enumerate(STATISTICS)}
    if means["entropy"] is None or means["max_weight"] is None:
        return ""
    counts = {name: int(queries[s]) for s, name in enumerate(STATISTICS)}
    return head_type(head_stats(layer, head, means, counts))[0]


def interval(sums: CorpusSums, l: int, h: int, s: int) -> Interval:  # noqa: E741
    c = float(sums.queries[l, s])
    n = int(sums.examples_with[l, s])
    if c <= 0:
        return Interval(None, None, None, 0, n)
    mean = float(sums.total[l, h, s]) / c
    if n < 2:
        return Interval(mean, None, None, int(c), n)
    residual = (float(sums.squares[l, h, s]) - 2 * mean * float(sums.products[l, h, s])
                + mean * mean * float(sums.query_squares[l, s]))
    se = math.sqrt(max(residual, 0.0) * n / (n - 1)) / c
    return Interval(mean, mean - Z95 * se, mean + Z95 * se, int(c), n)


def summarize_sums(sums: CorpusSums, layers: list[LayerInfo], read: int | None = None
                   ) -> CorpusSummary:
    """The summary of `sums`; read: the example ordinals the run spanned (examples read,
    skipped ones included; default: the examples added), the settle curve's last point."""
    R, L, H = sums.shape
    examples = int(sums.examples)
    read = examples if read is None else read
    edges = [e for e in band_edges() if e < read] + [read]
    band_total = sums.band_total.cumsum(0)  # prefix: examples < edge k
    band_queries = sums.band_queries.cumsum(0)
    heads = []
    for l, info in enumerate(layers):  # noqa: E741
        for h in range(info.heads):
            statistics = {name: interval(sums, l, h, s) for s, name in enumerate(STATISTICS)}
            kind = _type_of(info.index, h, sums.total[l, h], sums.queries[l])
            same = sum(_type_of(info.index, h, sums.boot_total[r, l, h], sums.boot_queries[r, l])
                       == kind for r in range(R))
            # band k's prefix holds examples < edges[k]; the last point is every example
            curve = tuple(_type_of(info.index, h, band_total[k, l, h], band_queries[k, l])
                          if k < len(edges) - 1 else kind for k in range(len(edges)))
            heads.append(CorpusHead(info.index, info.label, h, statistics, kind,
                                    same / R if R else float("nan"), _settled(curve, edges),
                                    curve))
    return CorpusSummary(layers, heads, examples, int(sums.tokens), R, tuple(edges))


def _settled(curve: tuple[str, ...], edges: list[int]) -> int | None:
    """The first example count from which the type stayed the final one."""
    if not curve:
        return None
    at = len(curve) - 1
    while at > 0 and curve[at - 1] == curve[-1]:
        at -= 1
    return edges[at]
