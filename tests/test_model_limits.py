"""`heatmap --model`: every limit is checked before the weights load, and one error names every
limit a too-long input breaks (--budget tokens and the model's positions together)."""

from __future__ import annotations

import pytest
from helpers import assert_clean_error, lazy_import

lazy_import("transformers")
pytestmark = pytest.mark.hf


DISTILBERT = "sample_weights/models/distilbert-tiny-model"  # 64 positions, 2 layers × 4 heads
MARIAN = "sample_weights/models/marian-tiny-model"  # 64 positions, 2 + 2 layers × 4 heads


class WeightsLoaded(Exception):
    pass


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the weights fails loudly: an error that still appears was found before it."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise WeightsLoaded("the weights were loaded")

    from attnviz.sources.hf import load

    monkeypatch.setattr(load, "load_weights", refuse)  # as the model source calls it
    return calls


def words(n: int) -> str:
    return " ".join(["cat"] * n)


def test_over_both_limits_names_both_at_once(cli, no_weights):
    result = cli("heatmap", "--model", DISTILBERT, words(100), "--budget", "tokens=80")
    assert_clean_error(result, 2, "--budget tokens 80 and the 64 positions the model knows",
                       "shorten it to at most 64 tokens", "raising --budget tokens cannot help")
    assert no_weights == []


def test_over_the_model_only_names_the_model_limit(cli, no_weights):
    result = cli("heatmap", "--model", DISTILBERT, words(100), "--budget", "tokens=500")
    assert_clean_error(result, 2, "more than the 64 positions the model knows",
                       "shorten it to at most 64 tokens")
    assert "--budget tokens" not in result.stderr
    assert no_weights == []


def test_over_max_tokens_only_says_how_far_to_raise_it(cli, no_weights):
    result = cli("heatmap", "--model", DISTILBERT, words(20), "--budget", "tokens=10")
    assert_clean_error(result, 2, "more than --budget tokens 10",
                       "raise --budget tokens (to at most 64: the model knows no more positions)")
    assert no_weights == []


def test_target_limits_are_checked_before_loading_too(cli, no_weights):
    result = cli("heatmap", "--model", MARIAN, "a b", "--target", words(100))
    assert_clean_error(result, 2, "--target 1 has", "64 positions the model knows")
    assert no_weights == []


def test_panel_limit_is_checked_before_loading(cli, no_weights, tmp_path):
    out = tmp_path / "maps.png"
    result = cli("heatmap", "--model", DISTILBERT, "the cat sat", "--layer", "all",
                 "--out", out, "--budget", "panels=5")
    assert_clean_error(result, 2, "--budget panels")
    assert no_weights == [] and not out.exists()


def test_within_every_limit_the_weights_do_load(cli, no_weights, tmp_path):
    """Negative control: the fixture does stop a run that passed every check."""
    result = cli("heatmap", "--model", DISTILBERT, "the cat sat", "--budget", "tokens=10",
                 "--out", tmp_path / "maps.png", "--budget", "panels=8")
    assert len(no_weights) == 1
    assert result.exit_code == 1 and "the weights were loaded" in result.stderr


@pytest.mark.parametrize("kind, positions", [
    ("roberta", 68),  # 70 learned rows, numbered from padding_idx + 1 = 2: 68 tokens
    ("bert", 64),  # negative control: no padding index in its position table, all 64 rows
])
def test_the_position_limit_is_what_the_table_can_number(cli, zoo_model, kind, positions):
    """RoBERTa's positions start after its padding index, so config.json's 70 learned positions
    number 68 tokens: one more is refused before the weights load (it crashed inside the
    model), and the longest allowed input runs."""
    folder = zoo_model(kind)
    # 'the' repeated: the tokenizer adds <s> (and </s> for RoBERTa) around the words
    specials = 2 if kind == "roberta" else 1
    too_long = " ".join(["the"] * (positions + 1 - specials))
    result = cli("heatmap", "--model", folder, too_long, "--budget", "tokens=200")
    assert_clean_error(result, 2, f"has {positions + 1} tokens",
                       f"more than the {positions} positions the model knows")
    fits = " ".join(["the"] * (positions - specials))
    assert cli("heatmap", "--model", folder, fits, "--budget", "tokens=200").exit_code == 0
