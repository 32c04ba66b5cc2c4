"""A head statistic's difference between two models over the same examples, with a 95 %
interval that treats examples as the unit (the queries of one example are not independent).

Each example i gives, per head, a value in each model: either the statistic itself (s_i, with
count c_i = 1: the result is the mean over examples), or a sum over the example's queries s_i
with the number of queries c_i it was taken over (the result is the ratio Σs / Σc, the mean over
all queries, with examples as clusters). The difference D = R_B − R_A (B minus A) is paired:
both models see example i, so its uncertainty comes from the per-example residuals

    z_i = (s_i^B − R_B c_i^B) / c̄^B − (s_i^A − R_A c_i^A) / c̄^A,     Var(D) ≈ Σ z_i² / (n (n − 1))

(the delta method; with c_i = 1 it is the paired t interval on d_i = b_i − a_i). The interval
is D ± t_{n−1, 0.975} · SE.

Streamed: `PairedMoments` keeps fifteen float64 sums per head, from which Σ z² follows exactly;
batches are added one at a time, and two accumulators (two processes' shares, a resumed run)
merge by adding their sums. `paired_bootstrap` is the resampling alternative on per-example
values kept in memory (percentile interval)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.comparison.student_t import two_sided

# The sums kept per head, in this order (a: model A, b: model B, s: value, c: count).
MOMENTS = ("n", "sa", "sb", "ca", "cb", "sa2", "sb2", "ca2", "cb2", "sa_ca", "sb_cb", "sa_sb",
           "sa_cb", "sb_ca", "ca_cb")
_AT = {name: i for i, name in enumerate(MOMENTS)}
LEVEL = 0.95


@dataclass(frozen=True)
class PairedDifference:
    """Per head (any trailing shape, e.g. layers × heads): both means, B − A, its standard
    error and interval; float64. Heads with fewer than two examples have a NaN interval."""

    examples: torch.Tensor  # examples that gave a value in both models
    mean_a: torch.Tensor
    mean_b: torch.Tensor
    diff: torch.Tensor  # mean_b − mean_a
    se: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    level: float
    method: str  # how the interval was made

    def excludes_zero(self) -> torch.Tensor:
        """Heads whose interval lies wholly on one side of 0 (False where it is NaN)."""
        return (self.low > 0) | (self.high < 0)

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "method": self.method,
                **{name: getattr(self, name).tolist()
                   for name in ("examples", "mean_a", "mean_b", "diff", "se", "low", "high")}}


@dataclass
class PairedMoments:
    """Streamed sums for `PairedDifference`: `sums` is (15, *shape) float64, one row per name
    in MOMENTS. Add batches with `add`, combine shares with `merge` (or an all_reduce of
    `sums`), read the result with `result`."""

    sums: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> PairedMoments:
        return cls(torch.zeros((len(MOMENTS), *shape), dtype=torch.float64))

    def add(self, a: torch.Tensor, b: torch.Tensor, count_a: torch.Tensor | None = None,
            count_b: torch.Tensor | None = None) -> None:
        """One batch: a and b are (examples, *shape) values (or per-example sums, with
        counts of the same shape). An example counts for a head where both values are finite
        (and, with counts, where it has queries in either model)."""
        sa, sb = a.to(torch.float64), b.to(torch.float64)
        if sa.shape != sb.shape or sa.shape[1:] != self.sums.shape[1:]:
            raise ValueError(f"values of shapes {tuple(a.shape)} and {tuple(b.shape)} do not "
                             f"fit per-head sums of shape {tuple(self.sums.shape[1:])}")
        ca = torch.ones_like(sa) if count_a is None else count_a.to(torch.float64)
        cb = torch.ones_like(sb) if count_b is None else count_b.to(torch.float64)
        used = torch.isfinite(sa) & torch.isfinite(sb) & ((ca > 0) | (cb > 0))
        zero = torch.zeros((), dtype=torch.float64)
        sa, sb, ca, cb = (torch.where(used, t, zero) for t in (sa, sb, ca, cb))
        terms = {"n": used.to(torch.float64), "sa": sa, "sb": sb, "ca": ca, "cb": cb,
                 "sa2": sa * sa, "sb2": sb * sb, "ca2": ca * ca, "cb2": cb * cb,
                 "sa_ca": sa * ca, "sb_cb": sb * cb, "sa_sb": sa * sb, "sa_cb": sa * cb,
                 "sb_ca": sb * ca, "ca_cb": ca * cb}
        self.sums += torch.stack([terms[name].sum(0) for name in MOMENTS])

    def merge(self, other: PairedMoments) -> None:
        self.sums += other.sums

    def result(self, level: float = LEVEL) -> PairedDifference:
        m = {name: self.sums[i] for name, i in _AT.items()}
        n = m["n"]
        r_a, r_b = m["sa"] / m["ca"], m["sb"] / m["cb"]  # the two means (ratios)
        mean_ca, mean_cb = m["ca"] / n, m["cb"] / n
        # Σ u², Σ v², Σ u·v for u_i = s_i^B − R_B c_i^B, v_i = s_i^A − R_A c_i^A, expanded
        uu = m["sb2"] - 2 * r_b * m["sb_cb"] + r_b * r_b * m["cb2"]
        vv = m["sa2"] - 2 * r_a * m["sa_ca"] + r_a * r_a * m["ca2"]
        uv = m["sa_sb"] - r_a * m["sb_ca"] - r_b * m["sa_cb"] + r_a * r_b * m["ca_cb"]
        zz = uu / mean_cb**2 + vv / mean_ca**2 - 2 * uv / (mean_ca * mean_cb)
        se = torch.sqrt(zz.clamp(min=0) / (n * (n - 1)))
        se = torch.where(n >= 2, se, torch.full_like(se, float("nan")))
        diff = r_b - r_a
        half = torch.tensor([two_sided(level, df) if df >= 1 else float("nan")
                             for df in (n - 1).reshape(-1).tolist()],
                            dtype=torch.float64).reshape(n.shape) * se
        return PairedDifference(n.to(torch.int64), r_a, r_b, diff, se, diff - half, diff + half,
                                level, "paired, per-example variance (t interval)")


def paired_difference(a: torch.Tensor, b: torch.Tensor, count_a: torch.Tensor | None = None,
                      count_b: torch.Tensor | None = None,
                      level: float = LEVEL) -> PairedDifference:
    """`PairedMoments` over per-example values (examples, *shape) held in memory."""
    moments = PairedMoments.zeros(tuple(a.shape[1:]))
    moments.add(a, b, count_a, count_b)
    return moments.result(level)


@dataclass(frozen=True)
class Bootstrap:
    """How `paired_bootstrap` resamples."""

    resamples: int = 2000
    seed: int = 0
    level: float = LEVEL
    chunk: int = 200  # resamples drawn at once: memory is chunk × examples float64


def paired_bootstrap(a: torch.Tensor, b: torch.Tensor, count_a: torch.Tensor | None = None,
                     count_b: torch.Tensor | None = None,
                     how: Bootstrap = Bootstrap()) -> PairedDifference:
    """The same difference with a percentile interval from `how.resamples` resamplings of
    whole examples (both models resampled together: the pairing is kept). Examples without a
    value in both models are dropped per head as `PairedMoments.add` drops them."""
    resamples, level, chunk = how.resamples, how.level, how.chunk
    sa, sb = a.to(torch.float64), b.to(torch.float64)
    ca = torch.ones_like(sa) if count_a is None else count_a.to(torch.float64)
    cb = torch.ones_like(sb) if count_b is None else count_b.to(torch.float64)
    used = torch.isfinite(sa) & torch.isfinite(sb) & ((ca > 0) | (cb > 0))
    zero = torch.zeros((), dtype=torch.float64)
    sa, sb, ca, cb = (torch.where(used, t, zero).reshape(len(a), -1) for t in (sa, sb, ca, cb))
    n = len(a)
    gen = torch.Generator().manual_seed(how.seed)
    draws = []
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        picks = torch.randint(0, n, (size, n), generator=gen)
        rows = picks + n * torch.arange(size).unsqueeze(1)  # each resample's own n bins
        weights = torch.bincount(rows.reshape(-1), minlength=size * n).reshape(size, n)
        weights = weights.to(torch.float64)  # (R, n): how often each example was drawn
        draws.append(weights @ sb / (weights @ cb) - weights @ sa / (weights @ ca))  # (R, K)
    replicates = torch.cat(draws)  # (resamples, K)
    shape = tuple(a.shape[1:])
    r_a, r_b = sa.sum(0) / ca.sum(0), sb.sum(0) / cb.sum(0)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.nanquantile(replicates, q, dim=0)
    count = used.reshape(n, -1).sum(0)
    few = count < 2
    nan = torch.full_like(low, float("nan"))
    low, high = torch.where(few, nan, low), torch.where(few, nan, high)
    se = torch.where(few, nan, _nanstd(replicates))
    return PairedDifference(count.reshape(shape), r_a.reshape(shape), r_b.reshape(shape),
                            (r_b - r_a).reshape(shape), se.reshape(shape), low.reshape(shape),
                            high.reshape(shape), level,
                            f"paired bootstrap over examples ({resamples} resamples, "
                            "percentile interval)")


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    """Standard deviation over dim 0 ignoring NaN (a resample that drew no example with
    queries gives 0/0)."""
    ok = torch.isfinite(x)
    k = ok.sum(0).to(torch.float64)
    mean = torch.where(ok, x, 0).sum(0) / k
    return torch.sqrt((torch.where(ok, x - mean, 0) ** 2).sum(0) / (k - 1))
