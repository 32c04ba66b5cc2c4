"""Paired per-head differences with intervals (attnviz.compute.comparison.paired, student_t).

Independent references: the t quantile against the t density integrated numerically here; the
plain paired interval against numpy's mean and standard deviation of per-example differences;
the ratio (queries within examples) interval against an explicit per-example loop, and against
simulation: intervals over examples cover the true difference about 95 % of the time, while the
naive interval that treats queries as independent (the negative control) covers far less."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnviz.compute.comparison.paired import (
    Bootstrap,
    PairedMoments,
    paired_bootstrap,
    paired_difference,
)
from attnviz.compute.comparison.student_t import LARGE_DF, t_cdf, t_quantile, two_sided


def t_cdf_by_integration(t: float, df: float, steps: int = 200_001) -> float:
    """P(T <= t) from the t density, integrated by Simpson's rule on [0, |t|]."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(0.0, abs(t), steps)
    density = np.exp(log_norm - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    area = h / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum()
                    + 2 * density[2:-1:2].sum())
    return 0.5 + math.copysign(area, t)


@pytest.mark.parametrize("df", [1, 2, 3, 9, 29, 299, 300, 5000])
def test_t_quantile_matches_the_integrated_density(df):
    q = two_sided(0.95, df)
    assert t_cdf_by_integration(q, df) == pytest.approx(0.975, abs=1e-9)
    assert t_cdf(q, df) == pytest.approx(0.975, abs=1e-11)
    assert t_quantile(0.025, df) == -q


def test_normal_quantile_fails_the_same_check():
    """Negative control: 1.96 (the normal quantile) is not the t quantile for 5 degrees of
    freedom; the integration tells them apart."""
    assert abs(t_cdf_by_integration(1.959964, 5) - 0.975) > 0.01
    assert LARGE_DF <= 5000  # the expansion branch was exercised above


def test_plain_paired_interval_equals_numpy():
    gen = np.random.default_rng(1)
    a = gen.normal(0.3, 0.1, size=(12, 2, 3))
    b = a + gen.normal(0.05, 0.02, size=a.shape)
    result = paired_difference(torch.tensor(a), torch.tensor(b))
    d = b - a
    se = d.std(axis=0, ddof=1) / math.sqrt(12)
    half = t_quantile_by_bisection(0.975, 11) * se
    np.testing.assert_allclose(result.diff.numpy(), d.mean(0), rtol=1e-12)
    np.testing.assert_allclose(result.se.numpy(), se, rtol=1e-9)
    np.testing.assert_allclose(result.low.numpy(), d.mean(0) - half, rtol=1e-8)
    np.testing.assert_allclose(result.high.numpy(), d.mean(0) + half, rtol=1e-8)
    assert result.examples.tolist() == [[12] * 3] * 2
    assert bool(result.excludes_zero().all())


def t_quantile_by_bisection(p: float, df: float) -> float:
    low, high = 0.0, 50.0
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf_by_integration(middle, df) < p else (low, middle)
    return (low + high) / 2


def test_ratio_interval_equals_an_explicit_per_example_loop():
    """Sums over queries with counts: R = Σs / Σc per model, SE² = Σ z_i² / (n (n − 1)) with
    z_i = (s_i^B − R_B c_i^B) / c̄^B − (s_i^A − R_A c_i^A) / c̄^A, computed example by example."""
    gen = np.random.default_rng(2)
    n = 30
    ca = gen.integers(0, 9, size=(n, 4)).astype(float)
    cb = gen.integers(1, 9, size=(n, 4)).astype(float)
    sa = ca * gen.uniform(0, 1, size=(n, 4))
    sb = cb * gen.uniform(0, 1, size=(n, 4))
    result = paired_difference(*map(torch.tensor, (sa, sb, ca, cb)))
    for k in range(4):
        r_a = sum(sa[:, k]) / sum(ca[:, k])
        r_b = sum(sb[:, k]) / sum(cb[:, k])
        mean_ca, mean_cb = sum(ca[:, k]) / n, sum(cb[:, k]) / n
        z = [(sb[i, k] - r_b * cb[i, k]) / mean_cb - (sa[i, k] - r_a * ca[i, k]) / mean_ca
             for i in range(n)]
        se = math.sqrt(sum(v * v for v in z) / (n * (n - 1)))
        assert float(result.diff[k]) == pytest.approx(r_b - r_a, rel=1e-12)
        assert float(result.se[k]) == pytest.approx(se, rel=1e-9)
        assert float(result.high[k] - result.low[k]) == pytest.approx(
            2 * t_quantile_by_bisection(0.975, n - 1) * se, rel=1e-7)


def simulate(sims: int, n: int, seed: int):
    """`sims` corpora of n examples: each example has its own level (shared by its queries in
    both models: queries within an example are correlated), B is A + 0.05 plus noise."""
    gen = np.random.default_rng(seed)
    counts = gen.integers(1, 20, size=(n, sims)).astype(float)
    level = gen.normal(0.0, 1.0, size=(n, sims))
    shift = 0.05 + gen.normal(0.0, 0.2, size=(n, sims))  # per-example change, mean 0.05
    sa = counts * level + np.sqrt(counts) * gen.normal(0, 0.1, size=(n, sims))
    sb = counts * (level + shift) + np.sqrt(counts) * gen.normal(0, 0.1, size=(n, sims))
    return counts, sa, sb


def test_intervals_over_examples_cover_the_truth():
    """Coverage over 2000 simulated corpora of 40 examples. The truth of the ratio estimand is
    the difference of expected sums over expected counts: Σ c_i·shift_i / Σ c_i has mean 0.05
    (shift is independent of the count), so the intervals should hold 0.05 in ~95 %."""
    counts, sa, sb = simulate(2000, 40, seed=3)
    result = paired_difference(*map(torch.tensor, (sa, sb, counts, counts)))
    covered = float(((result.low <= 0.05) & (0.05 <= result.high)).double().mean())
    assert 0.93 <= covered <= 0.97
    # Negative control: queries as the unit (each query its own observation) ignores that
    # an example's queries share its shift, and its interval is far too narrow.
    total = counts.sum(0)
    d_query_mean = (sb - sa).sum(0) / total
    per_query_var = ((sb - sa) ** 2 / counts).sum(0) / total - d_query_mean**2
    naive_half = 1.96 * np.sqrt(per_query_var / total)
    naive = np.mean(np.abs(d_query_mean - 0.05) <= naive_half)
    assert naive < 0.8


def test_streamed_batches_and_merged_shares_equal_one_pass():
    counts, sa, sb = simulate(5, 50, seed=4)
    whole = paired_difference(*map(torch.tensor, (sa, sb, counts, counts)))
    streamed = PairedMoments.zeros((5,))
    for start in range(0, 50, 7):
        part = slice(start, start + 7)
        streamed.add(*(torch.tensor(x[part]) for x in (sa, sb, counts, counts)))
    first, second = PairedMoments.zeros((5,)), PairedMoments.zeros((5,))
    first.add(*(torch.tensor(x[:20]) for x in (sa, sb, counts, counts)))
    second.add(*(torch.tensor(x[20:]) for x in (sa, sb, counts, counts)))
    first.merge(second)
    for other in (streamed.result(), first.result()):
        for name in ("diff", "se", "low", "high"):
            torch.testing.assert_close(getattr(other, name), getattr(whole, name),
                                       rtol=1e-10, atol=1e-14)
        assert other.examples.tolist() == [50] * 5


def test_missing_values_drop_the_example_for_that_head_only():
    gen = np.random.default_rng(5)
    a = gen.normal(size=(10, 2))
    b = a + gen.normal(0.5, 0.1, size=a.shape)
    a_missing = a.copy()
    a_missing[3, 1] = np.nan
    result = paired_difference(torch.tensor(a_missing), torch.tensor(b))
    kept = paired_difference(torch.tensor(np.delete(a[:, 1:], 3, axis=0)),
                             torch.tensor(np.delete(b[:, 1:], 3, axis=0)))
    assert result.examples.tolist() == [10, 9]
    torch.testing.assert_close(result.high[1], kept.high[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(result.high[0],
                               paired_difference(torch.tensor(a[:, :1]),
                                                 torch.tensor(b[:, :1])).high[0])


def test_identical_values_give_a_zero_interval_and_one_example_none():
    a = torch.rand(8, 3, dtype=torch.float64)
    same = paired_difference(a, a.clone())
    assert same.diff.abs().max() == 0 and same.se.abs().max() == 0
    assert not bool(same.excludes_zero().any())
    one = paired_difference(a[:1], a[:1] + 1)
    assert torch.isnan(one.low).all()
    torch.testing.assert_close(one.diff, torch.ones(3, dtype=torch.float64))


def test_bootstrap_agrees_with_the_per_example_variance():
    counts, sa, sb = simulate(3, 400, seed=6)
    args = [torch.tensor(x) for x in (sa, sb, counts, counts)]
    analytic = paired_difference(*args)
    boot = paired_bootstrap(*args, how=Bootstrap(1000, seed=1))
    torch.testing.assert_close(boot.diff, analytic.diff, rtol=1e-12, atol=0)
    assert ((boot.se / analytic.se - 1).abs() < 0.1).all()
    assert ((boot.high - boot.low) / (analytic.high - analytic.low) - 1).abs().max() < 0.12
    again = paired_bootstrap(*args, how=Bootstrap(1000, seed=1))
    assert torch.equal(again.low, boot.low)
    # negative control: unpaired resampling (A and B drawn independently) loses the pairing
    # and gives a much wider interval here, where per-example levels dominate
    unpaired = paired_bootstrap(args[0], args[1][torch.randperm(400)], args[2], args[3],
                                how=Bootstrap(500, seed=1))
    assert ((unpaired.high - unpaired.low) > 3 * (boot.high - boot.low)).all()
