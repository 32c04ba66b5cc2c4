"""attnviz corpus, the statistics: every mean, interval, query count, stability and settle
point recomputed independently from each example's own heatmap statistics (attnviz.api's
run_heatmap on that example alone), with negative controls showing the checks can fail;
streaming, bucketing and padding change nothing."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from attnviz.api import run_heatmap
from attnviz.app.corpus import CorpusRequest, run_corpus
from attnviz.compute.corpus.corpus_sums import STATISTICS, band_edges
from attnviz.compute.measures.overview import head_type
from attnviz.compute.measures.stats import HeadStats
from attnviz.core.choices import Weighting
from attnviz.core.words import split_words

pytestmark = pytest.mark.usefixtures("one_thread")
ENGLISH = ROOT / "sample_weights" / "english.txt"
COUNTED_BY_TOKENS = ("entropy", "max_weight", "distance")
Z95 = statistics.NormalDist().inv_cdf(0.975)


def sentences(count: int, start: int = 0) -> list[str]:
    lines = ENGLISH.read_text(encoding="utf-8").splitlines()
    return lines[start:start + count]


def corpus_file(tmp_path: Path, texts: list[str], name: str = "c.txt") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def per_example(texts: list[str], weighting: str = "attention"
                ) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(layer, head) → (s (N, S), c (N, S)): each example's sum and query count of every
    statistic, from heatmap's statistics of that example alone."""
    out: dict[tuple[int, int], tuple[list, list]] = {}
    for text in texts:
        n = len(split_words(text))
        for st in run_heatmap([text], weighting=weighting).head_stats:
            queries = dict(st.queries)
            s_row, c_row = [], []
            for name in STATISTICS:
                c = n if name in COUNTED_BY_TOKENS else queries[name]
                mean = getattr(st, name)
                s_row.append(0.0 if mean is None else mean * c)
                c_row.append(c if mean is not None else 0)
            pair = out.setdefault((st.layer, st.head), ([], []))
            pair[0].append(s_row)
            pair[1].append(c_row)
    return {key: (np.array(s, dtype=np.float64), np.array(c, dtype=np.float64))
            for key, (s, c) in out.items()}


def ratio_interval(s: np.ndarray, c: np.ndarray) -> tuple[float, float, float, int]:
    """(mean, low, high, examples) written out from the per-example values: the residuals
    s_i - R c_i computed one by one (not from the accumulated moments)."""
    used = c > 0
    n = int(used.sum())
    mean = s.sum() / c.sum()
    residuals = s[used] - mean * c[used]
    se = math.sqrt((residuals ** 2).sum() * n / (n - 1)) / c.sum()
    return mean, mean - Z95 * se, mean + Z95 * se, n


@pytest.fixture(scope="module")
def twenty(tmp_path_factory):
    texts = sentences(20)
    path = corpus_file(tmp_path_factory.mktemp("corpus"), texts)
    return texts, run_corpus(CorpusRequest(path, resamples=50)), per_example(texts)


def test_means_intervals_and_counts_equal_each_examples_own_statistics(twenty):
    texts, result, examples = twenty
    checked = 0
    for head in result.summary.heads:
        s, c = examples[(head.layer, head.head)]
        for k, name in enumerate(STATISTICS):
            got = head.statistics[name]
            assert got.queries == int(c[:, k].sum())
            if c[:, k].sum() == 0:
                assert got.mean is None
                continue
            mean, low, high, n = ratio_interval(s[:, k], c[:, k])
            assert got.examples == n
            assert got.mean == pytest.approx(mean, rel=1e-5, abs=1e-7)
            assert got.low == pytest.approx(low, rel=1e-4, abs=1e-6)
            assert got.high == pytest.approx(high, rel=1e-4, abs=1e-6)
            checked += 1
    assert checked >= 4 * 10
    assert result.summary.examples == len(texts)


def test_negative_controls_the_mean_of_means_and_query_level_intervals_are_caught(twenty):
    """The checks above can fail: the unweighted mean of per-example means, and an interval
    that takes the queries as independent, differ from the corpus's numbers."""
    _, result, examples = twenty
    head = result.summary.heads[0]
    s, c = examples[(head.layer, head.head)]
    k = STATISTICS.index("distance")
    naive = float(np.mean(s[:, k] / c[:, k]))
    assert abs(naive - head.statistics["distance"].mean) > 1e-3
    got = head.statistics["entropy"]
    assert got.low is not None and got.high is not None
    perturbed = s.copy()
    perturbed[0, 0] *= 1.01  # one example's entropy 1 % off moves the interval
    _, low, _, _ = ratio_interval(perturbed[:, 0], c[:, 0])
    assert abs(low - got.low) > 1e-6


def test_head_types_are_heatmaps_rule_on_the_corpus_means(twenty):
    _, result, examples = twenty
    for head in result.summary.heads:
        s, c = examples[(head.layer, head.head)]
        assert head.type == head_type(_stats(head.layer, head.head, s.sum(0), c.sum(0)))[0]


def _stats(layer: int, head: int, s: np.ndarray, c: np.ndarray) -> HeadStats:
    values = {name: (float(s[k] / c[k]) if c[k] > 0 else None)
              for k, name in enumerate(STATISTICS)}
    queries = tuple((name, int(c[k])) for k, name in enumerate(STATISTICS)
                    if name not in COUNTED_BY_TOKENS)
    return HeadStats(layer=layer, head=head, queries=queries, **values)


def test_stability_is_the_share_of_poisson_resamples_giving_the_type(twenty):
    """Each example's weights drawn from (seed 0, its ordinal): recomputed here from the
    examples' own statistics, resample by resample."""
    _, result, examples = twenty
    weights = np.stack([np.random.Generator(np.random.PCG64(np.random.SeedSequence([0, i])))
                        .poisson(1.0, 50) for i in range(20)]).astype(np.float64)  # (N, R)
    for head in result.summary.heads:
        s, c = examples[(head.layer, head.head)]
        same = sum(head_type(_stats(head.layer, head.head, weights[:, r] @ s,
                                    weights[:, r] @ c))[0] == head.type for r in range(50))
        assert head.stability == same / 50


def test_settle_curve_is_the_type_of_each_prefix(twenty):
    _, result, examples = twenty
    edges = [e for e in band_edges() if e < 20] + [20]
    assert list(result.summary.checkpoints) == edges
    for head in result.summary.heads:
        s, c = examples[(head.layer, head.head)]
        expected = [head_type(_stats(head.layer, head.head, s[:k].sum(0), c[:k].sum(0)))[0]
                    for k in edges]
        assert list(head.curve) == expected
        last_change = max((i for i in range(1, len(expected)) if expected[i] != expected[i - 1]),
                          default=0)
        assert head.settled_at == edges[last_change]


def test_streaming_in_batches_of_one_equals_one_batch(tmp_path, twenty):
    texts, whole, _ = twenty
    path = corpus_file(tmp_path, texts)
    one_by_one = run_corpus(CorpusRequest(path, resamples=50, lookahead=1))
    assert one_by_one.counts.batches == 20 and whole.counts.batches == 1
    _assert_same(one_by_one, whole)
    # negative control: one example fewer is caught by the same comparison
    fewer = run_corpus(CorpusRequest(corpus_file(tmp_path, texts[:-1], "d.txt"), resamples=50))
    with pytest.raises(AssertionError):
        _assert_same(fewer, whole)


def _assert_same(a, b, rel: float = 1e-6) -> None:
    for name, tensor in a.sums.tensors().items():
        other = b.sums.tensors()[name]
        assert tensor.shape == other.shape, name
        assert np.allclose(tensor.numpy(), other.numpy(), rtol=rel, atol=1e-9), name
    assert a.sums.queries.equal(b.sums.queries) and a.sums.examples.equal(b.sums.examples)


def test_bucketing_by_length_pads_less_and_changes_nothing(tmp_path):
    texts = sentences(64, 100)
    path = corpus_file(tmp_path, texts)
    budget = 2 * 4 * 8 * 40 * 40 * 2 * 2  # about eight 40-token examples per batch
    small = run_corpus(CorpusRequest(path, resamples=20, lookahead=8, memory_budget=budget))
    sorted_ = run_corpus(CorpusRequest(path, resamples=20, lookahead=64, memory_budget=budget))
    assert sorted_.counts.padding < small.counts.padding
    _assert_same(sorted_, small)


def test_value_weighted_maps_through_the_same_path(tmp_path):
    texts = sentences(6, 40)
    result = run_corpus(CorpusRequest(corpus_file(tmp_path, texts), resamples=10,
                                      weighting=Weighting.NORM))
    examples = per_example(texts, "norm")
    plain = per_example(texts)
    for head in result.summary.heads:
        s, c = examples[(head.layer, head.head)]
        k = STATISTICS.index("previous")
        assert head.statistics["previous"].mean == pytest.approx(s[:, k].sum() / c[:, k].sum(),
                                                                 rel=1e-5)
    # negative control: the attention maps' statistic differs
    s, c = plain[(0, 0)]
    head = result.summary.heads[0]
    assert abs(head.statistics["previous"].mean - s[:, k].sum() / c[:, k].sum()) > 1e-3
