"""`CorpusSums`: the float64 accumulators of a corpus run (see the package docstring). Every
field is a tensor that merges by addition, so partial sums of batches, ranks (all-reduce) and a
resumed run's state add up to the same totals. Axes: R resamples, K bands, L layers, H heads
(the most any layer has), S statistics (STATISTICS, the keys of
`compute.measures.stats.stat_sums`)."""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, fields

import numpy as np
import torch

from attnviz.compute.measures.stats import PATTERNS

STATISTICS = ("entropy", "max_weight", "distance", *PATTERNS, "special")
DEFAULT_RESAMPLES = 200


@functools.lru_cache(maxsize=1)
def band_edges() -> tuple[int, ...]:
    """Example counts at which the settle curve looks: 1, 2, 3, 4, 6, 8, 12, 16, 24, … (each
    power of two and 1.5 times it), up to 2⁴⁸."""
    edges = {1, 2, 3}
    power = 2
    while power < 2**48:
        edges.update((power, power * 3 // 2))
        power *= 2
    return tuple(sorted(edges))


def band_of(ordinal: int) -> int:
    """The band of example `ordinal` (0-based): band k holds ordinals edge[k-1] .. edge[k] - 1."""
    return bisect.bisect_right(band_edges(), ordinal)


def poisson_weights(seed: int, ordinals: list[int], resamples: int) -> torch.Tensor:
    """(B, R) float64 Poisson(1) bootstrap weights, each example's drawn from (seed, ordinal)
    alone: the same whichever rank or batch sees it."""
    rows = [np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, o])))
            .poisson(1.0, resamples) for o in ordinals]
    return torch.from_numpy(np.stack(rows).astype(np.float64))


@dataclass
class CorpusSums:
    """Sums over the examples seen (float64; counts are whole numbers, exact below 2⁵³)."""

    total: torch.Tensor  # (L, H, S) Σ s_i
    squares: torch.Tensor  # (L, H, S) Σ s_i²
    products: torch.Tensor  # (L, H, S) Σ s_i c_i
    queries: torch.Tensor  # (L, S) Σ c_i
    query_squares: torch.Tensor  # (L, S) Σ c_i²
    examples_with: torch.Tensor  # (L, S) examples with c_i > 0
    boot_total: torch.Tensor  # (R, L, H, S) Σ w_ir s_i
    boot_queries: torch.Tensor  # (R, L, S) Σ w_ir c_i
    band_total: torch.Tensor  # (K, L, H, S) Σ s_i over the band's examples
    band_queries: torch.Tensor  # (K, L, S)
    examples: torch.Tensor  # () examples added
    tokens: torch.Tensor  # () their tokens

    @classmethod
    def zeros(cls, layers: int, heads: int, resamples: int = DEFAULT_RESAMPLES) -> CorpusSums:
        S, K = len(STATISTICS), len(band_edges()) + 1

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64)

        return cls(z(layers, heads, S), z(layers, heads, S), z(layers, heads, S), z(layers, S),
                   z(layers, S), z(layers, S), z(resamples, layers, heads, S),
                   z(resamples, layers, S), z(K, layers, heads, S), z(K, layers, S), z(), z())

    @property
    def shape(self) -> tuple[int, int, int]:
        """(R, L, H)."""
        R, L, H, _ = self.boot_total.shape
        return R, L, H

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every field by name (a state file's tensors; the all-reduce's list)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> CorpusSums:
        return cls(**{f.name: tensors[f.name].to(torch.float64) for f in fields(cls)})

    def merge(self, other: CorpusSums) -> None:
        """Add another run's sums (in place)."""
        for name, tensor in self.tensors().items():
            tensor += other.tensors()[name]

    def add(self, ordinals: list[int], sums: torch.Tensor, counts: torch.Tensor,
            tokens: int, seed: int) -> None:
        """Add a batch of examples: sums (B, L, H, S) and counts (B, L, S) float64, example b
        being the corpus's example `ordinals[b]` (its bootstrap weights and band)."""
        self.total += sums.sum(0)
        self.squares += (sums * sums).sum(0)
        self.products += (sums * counts[:, :, None, :]).sum(0)
        self.queries += counts.sum(0)
        self.query_squares += (counts * counts).sum(0)
        self.examples_with += (counts > 0).sum(0)
        weights = poisson_weights(seed, ordinals, self.boot_total.shape[0])  # (B, R)
        self.boot_total += torch.einsum("br,blhs->rlhs", weights, sums)
        self.boot_queries += torch.einsum("br,bls->rls", weights, counts)
        bands = torch.tensor([band_of(o) for o in ordinals])
        self.band_total.index_add_(0, bands, sums)
        self.band_queries.index_add_(0, bands, counts)
        self.examples += len(ordinals)
        self.tokens += tokens
