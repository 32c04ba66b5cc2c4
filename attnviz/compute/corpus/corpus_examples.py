"""Per-example sums of a batch's maps: for each example alone, each layer's and head's sum of
every statistic over its queries and the number of queries it averages over — what
`compute.stats.stat_sums` (`cross_sums` for cross-attention) gives for that example by itself,
so that padding and the batch an example shares change nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.compute.corpus.corpus_sums import STATISTICS
from attnviz.compute.results import AttentionRun
from attnviz.compute.stats import cross_sums, stat_sums
from attnviz.errors import UsageError, option


@dataclass(frozen=True)
class LayerInfo:
    """A layer of the run as the summary names it."""

    index: int
    label: str  # "3", "enc 0", "cross 1"
    heads: int

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "label": self.label, "heads": self.heads}


def run_layers(run: AttentionRun) -> list[LayerInfo]:
    return [LayerInfo(layer.index, layer.label or str(layer.index), layer.heads)
            for layer in run.layers]


def example_sums(run: AttentionRun, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums (B, L, H, S), counts (B, L, S)) float64 of a finished run's maps (value-weighted
    ones when the run was weighed), H = `heads` (layers with fewer heads are zero beyond)."""
    batch = run.batch
    B, L, S = len(batch.tokens), len(run.layers), len(STATISTICS)
    sums = torch.zeros(B, L, heads, S, dtype=torch.float64)
    counts = torch.zeros(B, L, S, dtype=torch.float64)
    for b in range(B):  # example outer: the sentence's pattern pairs are cached across layers
        for i, layer in enumerate(run.layers):
            if layer.weights is None:
                raise UsageError("a batch's maps streamed (they exceed the memory budget)",
                                 fix=f"raise {option('memory_budget')} or lower "
                                 f"{option('max_tokens')}", option="memory_budget")
            rows = layer.rows_of(batch)[b]
            one = layer.weights[b:b + 1]  # (1, H, L, S)
            if layer.kind == "cross":
                found, found_counts = cross_sums(one, [rows], [layer.columns_of(batch)[b]])
            else:
                found, found_counts = stat_sums(one, [rows])
            h = one.shape[1]
            for s, name in enumerate(STATISTICS):
                if name in found:
                    sums[b, i, :h, s] = found[name]
                    counts[b, i, s] = found_counts[name]
    return sums, counts
