"""Limit errors name every limit a sentence passes, at once: --budget tokens, the bundled model's
learned positions and --budget sentences, from the command line and from --file, before any
tensor is read."""

from __future__ import annotations

import pytest
from helpers import assert_clean_error

from attnviz.app.sentence_file import read_sentences
from attnviz.cli.main import flag_of
from attnviz.compute.forward_pass.inputs import TokenLimit, length_problem, make_batch
from attnviz.errors import UsageError, with_options
from attnviz.sources import bundled


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


POSITIONS = bundled.token_limit(bundled.open_bundled()).tokens  # read from the file, not assumed


def test_the_bundled_model_limit_comes_from_its_header():
    limit = bundled.token_limit(bundled.open_bundled(), "the bundled model")
    assert limit == TokenLimit(POSITIONS, "the bundled model") and 0 < POSITIONS < 256


def test_a_sentence_over_both_limits_names_both_in_one_line(cli):
    result = cli("heatmap", words(300))
    assert_clean_error(result, 2, f"sentence 1 has 300 tokens, more than --budget tokens 256 "
                       f"and the {POSITIONS} positions the bundled model knows")
    assert f"shorten the sentence to at most {POSITIONS} tokens (raising --budget tokens cannot " \
        "help)" in result.stderr


def test_following_the_fix_is_enough(cli):
    """The fix names the number that works: a sentence of that length runs."""
    assert cli("heatmap", words(POSITIONS), "--no-maps", "--no-stats").exit_code == 0
    assert_clean_error(cli("heatmap", words(POSITIONS + 1)), 2,
                       f"more than the {POSITIONS} positions the bundled model knows")


def test_under_max_tokens_but_over_the_positions(cli):
    result = cli("heatmap", words(POSITIONS + 10), "--budget", "tokens=1000")
    assert_clean_error(result, 2, f"sentence 1 has {POSITIONS + 10} tokens, more than the "
                       f"{POSITIONS} positions the bundled model knows")
    assert "--budget tokens" not in result.stderr.split("—")[0]  # --budget tokens was not passed


def test_over_max_tokens_only_says_how_far_it_can_be_raised(cli):
    result = cli("heatmap", "a b c d", "--budget", "tokens=3")
    assert_clean_error(result, 2, "more than --budget tokens 3")
    assert f"raise --budget tokens (to at most {POSITIONS}: the bundled model knows no more " \
        "positions)" in result.stderr


def test_a_file_line_over_both_limits(cli, tmp_path):
    path = tmp_path / "s.txt"
    path.write_text(f"a b\n{words(300)}\n")
    result = cli("heatmap", "-f", path)
    assert_clean_error(result, 2, f"sentence 2 (line 2) has 300 tokens, more than "
                       f"--budget tokens 256 and the {POSITIONS} positions the bundled model knows")


def test_count_and_length_in_one_error():
    with pytest.raises(UsageError) as info:
        make_batch([words(300), words(100), "a", "b"], max_sentences=3,
                   limit=TokenLimit(64, "the bundled model"))
    what, fix = with_options(info.value.what, flag_of), with_options(info.value.fix, flag_of)
    assert what.startswith("4 sentences exceed --max-sentences 3; sentence 1 has 300 tokens")
    assert "(1 more sentence too long)" in what
    assert fix == ("raise --max-sentences or pass fewer; shorten each to at most 64 tokens "
                   "(raising --max-tokens cannot help)")


def test_standalone_layers_have_no_position_limit(cli):
    """Negative control: --random sets no limit of its own, so only --budget tokens is named."""
    result = cli("heatmap", "--random", words(300))
    assert_clean_error(result, 2, "more than --budget tokens 256 (attention costs O(L²) per head)")
    assert "positions" not in result.stderr
    assert cli("heatmap", "--random", words(100), "--no-maps", "--no-stats").exit_code == 0


@pytest.mark.parametrize("count, max_tokens, limit, expected", [
    (10, 20, None, None),
    (10, 20, 30, None),
    (25, 20, None, "more than --max-tokens 20"),
    (25, 20, 30, "more than --max-tokens 20"),
    (25, 30, 20, "more than the 20 positions"),
    (40, 30, 20, "more than --max-tokens 30 and the 20 positions"),
    (40, None, 20, "more than the 20 positions"),
])
def test_length_problem(count, max_tokens, limit, expected):
    found = length_problem("s", count, max_tokens,
                           None if limit is None else TokenLimit(limit, "m"))
    if expected is None:
        assert found is None
    else:
        assert found is not None and expected in with_options(found[0], flag_of)


def test_read_sentences_names_the_source_limit(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text(f"{words(10)}\n")
    assert read_sentences(path, 256, 64) == [words(10)]
    with pytest.raises(UsageError, match="more than the 5 positions m knows"):
        read_sentences(path, 256, 64, limit=TokenLimit(5, "m"))


def test_limits_are_checked_before_any_tensor_is_read(cli, monkeypatch):
    """The model is never run: the limit comes from the header alone."""
    def fail(*args, **kwargs):
        raise AssertionError("run_tiny ran")

    monkeypatch.setattr(bundled, "run_tiny", fail)
    assert_clean_error(cli("heatmap", words(300)), 2, "and the")
