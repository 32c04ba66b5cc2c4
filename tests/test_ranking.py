"""Head ranking (--rank) and probe inputs (--probe): the statistics behind them equal a naive
loop, the ranking sorts them, and known heads come out on top on real weights."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_clean_error

from attnviz.compute.measures.ranking import HEAD_TYPES, rank_heads
from attnviz.compute.measures.stats import SPECIAL_RE, head_stats
from attnviz.core.probe import induction_probe


def test_last_and_special_equal_a_naive_loop():
    gen = torch.Generator().manual_seed(1)
    tokens = [["[CLS]", "a", "b", "a", "[SEP]"], ["<s>", "x", "y", "</s>", "<pad>", "z"]]
    maps = torch.softmax(torch.randn(2, 3, 6, 6, generator=gen), -1)
    stats = head_stats(maps, tokens, 0)
    for h in range(3):
        last = [float(maps[b, h, i, len(t) - 1]) for b, t in enumerate(tokens)
                for i in range(len(t) - 1)]
        special = [sum(float(maps[b, h, i, j]) for j, tok in enumerate(t) if SPECIAL_RE.match(tok))
                   for b, t in enumerate(tokens) for i in range(len(t))]
        assert stats[h].last == pytest.approx(sum(last) / len(last), rel=1e-5)
        assert stats[h].special == pytest.approx(sum(special) / len(special), rel=1e-5)


@pytest.mark.parametrize("token, special", [
    ("[CLS]", True), ("[SEP]", True), ("<s>", True), ("</s>", True), ("<|endoftext|>", True),
    ("<pad>", True), ("cat", False), ("[cat", False), ("<3", False), ("a>b", False), ("", False),
])
def test_special_tokens(token, special):
    assert bool(SPECIAL_RE.match(token)) is special


def test_ranking_sorts_each_statistic():
    n = 6
    tokens = [["[CLS]", "a", "b", "c", "d", "[SEP]"]]
    prev = torch.zeros(1, 1, n, n)
    prev[0, 0, 0, 0] = 1.0
    for i in range(1, n):
        prev[0, 0, i, i - 1] = 1.0
    last = torch.zeros(1, 1, n, n)
    last[0, 0, :, n - 1] = 1.0
    uniform = torch.full((1, 1, n, n), 1 / n)
    stats = head_stats(torch.cat([uniform, prev, last], 1), tokens, layer=2)
    ranking = {r.head_type: r for r in rank_heads(stats, top=2)}
    assert list(ranking) == list(HEAD_TYPES)
    assert (ranking["previous-token"].heads[0].head, ranking["last-token"].heads[0].head) == (1, 2)
    assert ranking["last-token"].heads[0].score == pytest.approx(1.0)
    assert ranking["broad"].heads[0].head == 0  # uniform: the highest entropy
    assert all(len(r.heads) == 2 for r in ranking.values() if r.heads)
    assert ranking["induction"].heads == []  # no repeated token: nothing to rank


def test_probe_repeats_each_span_exactly():
    for length, sentence in zip((4, 8, 16), induction_probe(seed=3), strict=True):
        words = sentence.split()
        assert len(words) == 2 * length and words[:length] == words[length:]
        assert len(set(words[:length])) == length  # no repeat before the copy
    assert induction_probe(seed=3) == induction_probe(seed=3) != induction_probe(seed=4)


def test_bundled_model_ranks_its_known_heads(cli):
    """The bundled model (sample_weights/NOTES_induction.md): a previous-token head in layer 0,
    induction heads in layer 1. The probe must find them, ranked first."""
    result = cli("heatmap", "--probe", "induction", "--rank", "--json")
    assert result.exit_code == 0, result.output
    ranking = {r["type"]: r["heads"] for r in json.loads(result.stdout)["ranking"]}
    best_previous = ranking["previous-token"][0]
    assert best_previous["layer"] == 0 and best_previous["score"] > 0.8
    assert {h["layer"] for h in ranking["induction"][:2]} == {1}
    assert ranking["induction"][0]["score"] > 0.6


def test_rank_in_the_terminal(cli):
    result = cli("heatmap", "--probe", "induction", "--rank", "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    assert "heads ranked by type" in result.stdout and "induction        L1." in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--probe", "copying"], "unknown --probe 'copying'"),
    (["--probe", "induction", "a b c"], "--probe replaces the sentences"),
])
def test_probe_misuse(cli, args, fragment):
    assert_clean_error(cli("heatmap", *args), 2, fragment)


@pytest.mark.hf
def test_minilm_ranking_names_its_previous_cls_and_sep_heads(cli, minilm):
    pytest.importorskip("transformers")
    result = cli("heatmap", "--model", minilm, "the quick brown fox jumps over the lazy dog",
                 "a man walked his dog in the park", "--rank", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    ranking = {r["type"]: r["heads"] for r in doc["ranking"]}
    stats = {(s["layer"], s["head"]): s for s in doc["head_stats"]}
    for head_type, statistic in (("previous-token", "previous"), ("first-token", "first"),
                                 ("last-token", "last")):
        best = ranking[head_type][0]
        assert best["score"] == max(s[statistic] for s in stats.values())
    assert ranking["previous-token"][0]["score"] > 0.9  # MiniLM's layer-0 previous-token head
    assert ranking["first-token"][0]["score"] > 0.8  # heads parked on [CLS]
