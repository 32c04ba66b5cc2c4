"""How well each method's ranking of input tokens agrees with erasing them: Spearman's rank
correlation (average ranks for ties), and its mean and spread over many inputs."""

from __future__ import annotations

import math

import torch


def ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks, ties sharing their average rank (float64)."""
    v = values.double().flatten()
    order = torch.argsort(v, stable=True)
    sorted_v = v[order]
    out = torch.empty_like(v)
    i, n = 0, len(v)
    while i < n:
        j = i
        while j + 1 < n and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        out[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's ρ (Pearson on the ranks); None when either side is constant or < 3 values."""
    if a.numel() != b.numel():
        raise ValueError("spearman needs two vectors of one length")
    if a.numel() < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(ra.norm() * rb.norm())
    if denominator == 0:
        return None
    return float((ra @ rb) / denominator)


def mean_spread(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample standard deviation, count) of the defined values."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return None, None, 0
    mean = sum(kept) / len(kept)
    if len(kept) < 2:
        return mean, None, len(kept)
    spread = math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
    return mean, spread, len(kept)
