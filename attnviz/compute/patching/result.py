"""What `attnviz patch` returns: the baselines, and one grid of effects per sweep, each cell the
patched run's metric on the normalized scale (0 = the corrupted run, 1 = the clean run), its
mean over the pairs and their spread, and the raw metric's mean."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from attnviz.core.choices import PatchDirection, PatchMetric

if TYPE_CHECKING:
    import torch

DIRECTIONS = {
    PatchDirection.DENOISING: "denoising: the corrupted run, each cell with one activation "
                              "patched in from the clean run (1 = it alone restores the clean "
                              "answer)",
    PatchDirection.NOISING: "noising: the clean run, each cell with one activation patched in "
                            "from the corrupted run (0 = it alone breaks the clean answer)",
}


@dataclass(frozen=True)
class Baselines:
    """The unpatched runs' metric, per pair."""

    metric: PatchMetric
    explained: str
    clean: list[float]
    corrupt: list[float]

    @property
    def clean_mean(self) -> float:
        return sum(self.clean) / len(self.clean)

    @property
    def corrupt_mean(self) -> float:
        return sum(self.corrupt) / len(self.corrupt)

    @property
    def scale(self) -> float:
        """clean − corrupted, of the means: the normalized scale's unit."""
        return self.clean_mean - self.corrupt_mean


@dataclass(frozen=True)
class EffectGrid:
    """One sweep: rows × cols cells (layers × heads, layers × positions, heads × positions)."""

    site: str  # heads, residual, q, k, v, pattern, path, attribution, …
    direction: PatchDirection
    title: str
    rows: list[str]
    cols: list[str]
    mean: list[list[float]]  # normalized metric, mean over pairs (NaN: undefined)
    spread: list[list[float]]  # its standard deviation over pairs (0 for one pair)
    raw: list[list[float]]  # the metric itself, mean over pairs
    col_notes: list[str] = field(default_factory=list)  # k/v: the query heads sharing a column
    notes: list[str] = field(default_factory=list)
    by_pair: list[list[list[float]]] = field(default_factory=list)  # [pair][row][col] metric

    def top(self, count: int = 5) -> list[tuple[str, str, float, float]]:
        """The cells farthest from the patched run's own baseline, (row, col, mean, spread)."""
        base = 0.0 if self.direction is PatchDirection.DENOISING else 1.0
        cells = [(r, c, self.mean[i][j], self.spread[i][j])
                 for i, r in enumerate(self.rows) for j, c in enumerate(self.cols)
                 if not math.isnan(self.mean[i][j])]
        return sorted(cells, key=lambda x: -abs(x[2] - base))[:count]


@dataclass(frozen=True)
class PairView:
    """One pair as tokens."""

    clean: list[str]
    corrupt: list[str]
    answer: list[str]
    wrong: str | None


@dataclass(frozen=True)
class PatchResult:
    """Everything `attnviz patch` computed."""

    model: str
    metric: PatchMetric
    pairs: list[PairView]
    baselines: Baselines
    grids: list[EffectGrid]
    heads: tuple[int, int, int]  # layers, heads, key/value heads
    forwards: int  # forward passes run, baselines included
    per_forward: int  # patched copies of the batch in one forward pass
    notes: list[str] = field(default_factory=list)

    def grid(self, site: str) -> EffectGrid | None:
        return next((g for g in self.grids if g.site == site), None)

    def to_json(self) -> dict[str, Any]:
        """Every number, the metric, the directions and the baselines (NaN as null)."""
        def clean(value: Any) -> Any:
            if isinstance(value, float):
                return None if math.isnan(value) else value
            if isinstance(value, list):
                return [clean(v) for v in value]
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            return value
        b = self.baselines
        return clean({
            "model": self.model,
            "metric": str(self.metric),
            "metric_explained": b.explained,
            "scale": "normalized: (metric - corrupted) / (clean - corrupted), of the means "
                     "over pairs; 0 = the corrupted run, 1 = the clean run",
            "baselines": {"clean": b.clean, "corrupted": b.corrupt,
                          "clean_mean": b.clean_mean, "corrupted_mean": b.corrupt_mean},
            "layers": self.heads[0], "heads": self.heads[1], "kv_heads": self.heads[2],
            "pairs": [asdict(p) for p in self.pairs],
            "grids": [{**{k: v for k, v in asdict(g).items() if k != "direction"},
                       "direction": str(g.direction),
                       "direction_explained": DIRECTIONS[g.direction]} for g in self.grids],
            "forwards": self.forwards, "copies_per_forward": self.per_forward,
            "notes": self.notes,
        })


def summarize(scores: torch.Tensor, baselines: Baselines
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C,) mean normalized metric, its spread over pairs, and the raw mean, of (C, P) scores:
    pair p normalized as (m_p − corrupted_p) / (clean − corrupted of the means), so the mean
    over pairs is the normalized mean metric."""
    import torch

    corrupt = torch.tensor(baselines.corrupt, dtype=torch.float64)
    scale = baselines.scale
    if scale == 0 or not math.isfinite(scale):
        nan = torch.full((scores.shape[0],), math.nan, dtype=torch.float64)
        return nan, nan, scores.mean(1)
    normal = (scores - corrupt[None]) / scale
    spread = normal.std(1, correction=1) if scores.shape[1] > 1 else torch.zeros_like(normal[:, 0])
    return normal.mean(1), spread, scores.mean(1)


def correlation(a: list[float], b: list[float]) -> float:
    """Pearson's r of two equally long lists (NaN when either is constant)."""
    import torch

    x = torch.tensor(a, dtype=torch.float64)
    y = torch.tensor(b, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else math.nan
