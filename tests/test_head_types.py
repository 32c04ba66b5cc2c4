"""Next-token and punctuation heads, the minimum-queries rule for labels, and the --rank footer:
statistics checked against sums written out by hand (numpy loops), the streamed (block by block)
statistics against the whole-map ones, each with a negative control."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from attnviz.compute.measures.stats import MIN_LABEL_QUERIES, head_stats, is_punctuation

TOKENS = [["the", "cat", ",", "sat", ".", "Ġon", "▁;", "mat", "...", "end"],
          ["a", "b", "c", "d", "e", "f"]]


def _maps(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    B, H, L = len(TOKENS), 3, max(map(len, TOKENS))
    logits = torch.randn(B, H, L, L) * 2
    for b, tokens in enumerate(TOKENS):
        logits[b, :, :, len(tokens):] = float("-inf")
    return torch.softmax(logits, -1)


def _by_hand(maps: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(next, punctuation) per head, as plain loops over real queries."""
    H = maps.shape[1]
    nxt, punct = np.zeros(H), np.zeros(H)
    n_next = n_punct = 0
    for b, tokens in enumerate(TOKENS):
        n = len(tokens)
        marks = [j for j, t in enumerate(tokens) if t.strip("Ġ▁") in
                 {".", ",", ";", "..."}]
        for i in range(n):
            if i < n - 1:
                nxt += maps[b, :, i, i + 1].numpy()
                n_next += 1
            if marks:
                punct += maps[b, :, i, marks].sum(-1).numpy()
                n_punct += 1
    return nxt / n_next, punct / n_punct


def test_next_and_punctuation_statistics():
    maps = _maps()
    stats = head_stats(maps, TOKENS, 0)
    nxt, punct = _by_hand(maps)
    assert [s.next for s in stats] == pytest.approx(nxt.tolist(), abs=1e-6)
    assert [s.punctuation for s in stats] == pytest.approx(punct.tolist(), abs=1e-6)
    assert [s.next for s in stats] != pytest.approx([s.previous for s in stats], abs=1e-3)


def test_punctuation_tokens():
    assert all(map(is_punctuation, [".", ",", ";", "Ġ.", "▁,", "...", "？", "##!"]))
    assert not any(map(is_punctuation, ["the", "a.b", "(", "", "Ġ", "[SEP]", "-"]))


def test_streamed_statistics_equal_whole_map_statistics():
    """The block-by-block path (attnviz.compute.measures.row_stats) adds up to head_stats."""
    from attnviz.compute.forward_pass.streaming import MapReducer

    maps = _maps(1)
    reducer = MapReducer(0, TOKENS)
    for b, tokens in enumerate(TOKENS):
        n = len(tokens)
        reducer.add(b, 0, maps[b, :, :n, :n].contiguous())
    streamed = reducer.finish().stats
    whole = head_stats(maps, TOKENS, 0)
    for field in ("next", "punctuation", "previous"):
        assert [getattr(s, field) for s in streamed] == pytest.approx(
            [getattr(s, field) for s in whole], abs=1e-5), field
    assert [s.queries for s in streamed] == [s.queries for s in whole]


def _one_hot(tokens: list[str], target) -> torch.Tensor:
    n = len(tokens)
    maps = torch.zeros(1, 1, n, n)
    for i in range(n):
        maps[0, 0, i, target(i, n)] = 1.0
    return maps


def test_next_token_head_is_labelled():
    tokens = "one two three four five six seven".split()
    stats = head_stats(_one_hot(tokens, lambda i, n: min(i + 1, n - 1)), [tokens], 0)[0]
    assert stats.label == "next-token"
    prev = head_stats(_one_hot(tokens, lambda i, n: max(i - 1, 0)), [tokens], 0)[0]
    assert prev.label == "previous-token"  # negative control


def test_one_repeated_word_does_not_make_an_induction_head():
    """'the cat sat on the mat': one query repeats a token — too few to name a head by it."""
    tokens = "the cat sat on the mat".split()
    # every query on the token after an earlier copy when there is one, else on itself
    target = lambda i, n: 1 if i == 4 else i  # noqa: E731
    stats = head_stats(_one_hot(tokens, target), [tokens], 0)[0]
    assert stats.induction == 1.0 and dict(stats.queries)["induction"] == 1
    assert stats.label != "induction"
    repeated = "a b c d e a b c d e".split()  # five queries repeat: enough
    target2 = lambda i, n: i - 4 if i >= 5 else i  # noqa: E731
    stats2 = head_stats(_one_hot(repeated, target2), [repeated], 0)[0]
    assert dict(stats2.queries)["induction"] >= MIN_LABEL_QUERIES
    assert stats2.induction == pytest.approx(1.0)
    assert stats2.label == "induction"


def test_rank_footer_only_when_a_dash_is_shown():
    from rich.console import Console

    from attnviz.compute.measures.ranking import HeadRanking, RankedHead
    from attnviz.render.ranking_terminal import print_ranking

    def printed(rankings):
        out = io.StringIO()
        print_ranking(Console(file=out, width=120), rankings)
        return out.getvalue()

    full = [HeadRanking("self", "self", "", [RankedHead(0, 0, 0.9)])]
    assert "no query in the input exercised" not in printed(full)
    empty = full + [HeadRanking("induction", "induction", "", [])]
    assert "no query in the input exercised" in printed(empty)


def test_overview_and_rank_name_the_new_types(cli):
    result = cli("heatmap", "a , b , c , d , e , f .", "--no-maps", "--no-stats", "--rank",
                 "--overview", "punctuation")
    assert result.exit_code == 0, result.output
    assert "next-token" in result.output and "punctuation" in result.output
    assert "overview: punctuation" in result.output
