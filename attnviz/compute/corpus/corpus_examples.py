"""Per-example sums of a batch's maps: for each example alone, each layer's and head's sum of
every statistic over its queries and the number of queries it averages over — what
`compute.measures.stats.stat_sums` (`cross_sums` for cross-attention) gives for that example by
itself
(`corpus_batch_stats` computes it for the whole batch at once), so that padding and the batch
an example shares change nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.compute.corpus.corpus_batch_stats import BatchPatterns, batch_patterns, batch_sums
from attnviz.compute.corpus.corpus_sums import STATISTICS
from attnviz.compute.forward_pass.results import AttentionRun
from attnviz.compute.measures.stats import cross_sums
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
    return [LayerInfo(layer.index, layer.label, layer.heads)
            for layer in run.layers]


def example_sums(run: AttentionRun, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums (B, L, H, S), counts (B, L, S)) float64 of a finished run's maps (value-weighted
    ones when the run was weighed), H = `heads` (layers with fewer heads are zero beyond)."""
    batch = run.batch
    B, L, S = len(batch.tokens), len(run.layers), len(STATISTICS)
    sums = torch.zeros(B, L, heads, S, dtype=torch.float64)
    counts = torch.zeros(B, L, S, dtype=torch.float64)
    patterns: dict[tuple[str, int], BatchPatterns] = {}  # by kind and size: shared by layers
    for i, layer in enumerate(run.layers):
        if layer.weights is None:
            raise UsageError("a batch's maps streamed (they exceed the memory budget)",
                             fix=f"raise {option('memory_budget')} or lower "
                             f"{option('max_tokens')}", option="memory_budget")
        h = layer.weights.shape[1]
        if layer.kind == "cross":  # rows one sequence, columns another: example by example
            for b, (rows, cols) in enumerate(zip(layer.rows_of(batch), layer.columns_of(batch),
                                                 strict=True)):
                found, found_counts = cross_sums(layer.weights[b:b + 1], [rows], [cols])
                for s, name in enumerate(STATISTICS):
                    sums[b, i, :h, s] = found[name]
                    counts[b, i, s] = found_counts[name]
            continue
        size = layer.weights.shape[-1]
        if (layer.kind, size) not in patterns:
            patterns[layer.kind, size] = batch_patterns(layer.rows_of(batch), size)
        sums[:, i, :h] = batch_sums(layer.weights, patterns[layer.kind, size])
        counts[:, i] = patterns[layer.kind, size].counts
    return sums, counts
