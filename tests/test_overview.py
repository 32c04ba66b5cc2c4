"""The layers × heads overview: head types from the run's own statistics, a grid that reads
without colour and fits 80 columns, --model's default view, and the same data in --json."""

from __future__ import annotations

import io
import json
import re

import pytest
from helpers import ROOT, assert_clean_error
from rich.console import Console

from attnviz.cli.heatmap_options import overview_default
from attnviz.compute.measures.overview import build_overview, head_type
from attnviz.compute.measures.stats import HeadStats
from attnviz.render.overview_terminal import overview_lines, print_overview

SAMPLE_MARIAN = ROOT / "sample_weights" / "models" / "marian-tiny-model"


def stats(layer: int = 0, head: int = 0, *, entropy: float = 1.0, max_weight: float = 0.3,
          first: float = 0.1, previous: float | None = 0.1, self: float | None = 0.1,
          last: float | None = 0.1, special: float | None = None,
          label: str | None = None) -> HeadStats:
    return HeadStats(layer, head, entropy, max_weight, 1.0, first, previous, self, None, None,
                     last, special, label)


@pytest.mark.parametrize("given, expected", [
    ({"previous": 0.9, "max_weight": 0.9}, ("previous-token", "previous", 0.9)),
    ({"first": 0.6, "special": 0.9, "max_weight": 0.7}, ("first-token", "first", 0.6)),
    ({"first": 0.3, "last": 0.3, "special": 0.6, "max_weight": 0.4},
     ("special-token", "special", 0.6)),
    ({"max_weight": 0.3, "entropy": 2.5}, ("broad", "entropy", 2.5)),
    ({"max_weight": 0.8}, ("other", "max_weight", 0.8)),
])
def test_head_type(given, expected):
    """The specific pattern (stats.label) wins over special tokens together, which win over
    broad; a sharp head on no listed pattern is 'other'."""
    assert head_type(stats(**given)) == expected


def test_rows_follow_layers_and_group_stacks():
    run = [stats(0, 0, label="enc 0"), stats(0, 1, label="enc 0"), stats(0, 0, label="dec 0"),
           stats(0, 0, label="cross 0", previous=None, self=None, last=None),
           stats(1, 0, label="dec 1"), stats(1, 0, label="cross 1")]
    overview = build_overview(run, "previous")
    assert [r.label for r in overview.rows] == ["enc 0", "dec 0", "dec 1", "cross 0", "cross 1"]
    assert [len(r.cells) for r in overview.rows] == [2, 1, 1, 1, 1]
    assert overview.rows[3].cells[0].value is None  # cross-attention has no previous token
    assert overview.statistic == "previous"


def render(overview, width: int = 80) -> str:
    out = io.StringIO()
    print_overview(Console(file=out, width=width, color_system=None), overview)
    return out.getvalue()


def grid(layers: int, heads: int, shows: str = "label") -> object:
    return build_overview([stats(layer, head, previous=0.9 if head % 3 == 0 else 0.1,
                                 max_weight=0.9 if head % 3 else 0.95,
                                 entropy=10.0 + head * 1.234567)
                           for layer in range(layers) for head in range(heads)], shows)


def test_twelve_heads_fit_80_columns_in_words_without_colour():
    text = render(grid(12, 12))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "\x1b" not in text
    assert lines[1].split() == ["layer", *map(str, range(12))]
    assert lines[2].split() == ["0", *["prev", "other", "other"] * 4]
    assert "prev the previous token" in text and "other sharp" in text
    assert "broad" not in text.split("key")[1]  # the key lists only the types shown


def test_many_heads_use_codes_then_wrap_into_even_blocks():
    narrow = render(grid(2, 16))
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert " prv " in narrow and "prv the previous token" in narrow
    wide = render(grid(2, 40))
    header_lines = [line for line in wide.splitlines() if line.startswith("layer")]
    # 18 code cells fit beside the labels: 3 blocks, as even as can be (14 + 14 + 12)
    assert [line.split()[1] for line in header_lines] == ["0", "14", "28"]
    assert max(len(line) for line in wide.splitlines()) <= 80


def test_numbers_are_never_cut():
    overview = grid(3, 24, "entropy")
    text = render(overview, 60)
    assert max(len(line) for line in text.splitlines()) <= 60
    for cell in overview.rows[0].cells:
        assert f"{cell.value:.2f}" in text


def test_the_grid_is_drawn_from_the_statistics():
    """Negative control: different statistics draw a different grid."""
    a = overview_lines(grid(2, 4), 80)
    b = overview_lines(build_overview([stats(0, h, max_weight=0.2) for h in range(4)]), 80)
    assert [str(x) for x in a] != [str(x) for x in b]
    assert str(b[1]).split() == ["0", "broad", "broad", "broad", "broad"]


@pytest.mark.parametrize("args, expected", [
    ((None, True, None, None, False, None), ("label", True)),
    (("entropy", True, None, None, False, None), ("entropy", True)),
    (("off", True, None, None, False, None), (None, False)),
    ((None, True, "3", None, False, None), (None, False)),
    ((None, True, None, 0, False, None), (None, False)),
    ((None, True, None, None, True, None), (None, False)),
    ((None, True, None, None, False, True), (None, False)),
    ((None, True, None, None, False, False), ("label", True)),
    ((None, False, None, None, False, None), (None, False)),
    (("max", False, None, None, False, None), ("max", False)),
])
def test_when_the_overview_shows(args, expected):
    """The terminal's default (attnviz.cli.heatmap_options, where the view is chosen)."""
    assert overview_default(*args) == expected


def test_unknown_overview_and_quiet(cli):
    assert_clean_error(cli("heatmap", "a b", "--overview", "sharpness"), 2,
                       "unknown --overview 'sharpness'")
    assert_clean_error(cli("heatmap", "a b", "--overview", "label", "--quiet"), 2,
                       "--quiet prints no maps or tables, but --overview asks for one")


def test_bundled_model_keeps_its_maps_and_adds_the_overview_when_asked(cli):
    plain = cli("heatmap", "the cat sat on the mat the cat sat")
    assert "overview" not in plain.stdout and "L1 · head 0" in plain.stdout
    asked = cli("heatmap", "the cat sat on the mat the cat sat", "--overview", "label")
    assert "overview: head types" in asked.stdout and "L1 · head 0" in asked.stdout
    assert re.search(r"^\s+1 ind\s+ind$", asked.stdout, re.M)  # the induction heads


# ------------------------------------------------------------------------------------------
# --model: the default view


MINILM_SENTENCES = ["the quick brown fox jumps over the lazy dog",
                    "a man walked his dog in the park"]


@pytest.fixture(scope="module")
def minilm_runs(minilm):
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from attnviz.cli import app

    runner = CliRunner()
    env = {"COLUMNS": "80", "NO_COLOR": "1"}
    return {name: runner.invoke(app, ["heatmap", "--model", str(minilm), *MINILM_SENTENCES,
                                      *args], env=env)
            for name, args in {"default": [], "json": ["--json"], "maps": ["--maps"],
                               "layer": ["--layer", "0"]}.items()}


@pytest.mark.hf
def test_minilm_default_is_the_overview(minilm_runs):
    result = minilm_runs["default"]
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "overview: head types, layers × heads" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "head statistics" not in text and "· head 0" not in text  # no table, no maps
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if re.fullmatch(r"\s+\d \S.*", line)}
    assert sorted(rows) == [str(i) for i in range(6)] and all(len(r) == 12 for r in rows.values())
    assert rows["0"][2] == "prev"  # the previous-token head --rank names
    assert sum(row.count("first") for row in rows.values()) > 10  # heads parked on [CLS]
    assert "[CLS] the quick brown fox" in text  # the tokens, which no map shows now
    assert len(text.splitlines()) < 40


@pytest.mark.hf
def test_minilm_json_overview_is_the_run_s_own_statistics(minilm_runs):
    doc = json.loads(minilm_runs["json"].stdout)
    stats = {(s["layer"], s["head"]): s for s in doc["head_stats"]}
    overview = doc["overview"]
    assert overview["shows"] == "label" and len(overview["rows"]) == 6
    for row in overview["rows"]:
        for cell in row["heads"]:
            s = stats[(row["layer"], cell["head"])]
            assert cell["score"] == s[cell["statistic"]]
            if s["label"]:
                assert cell["type"] == s["label"]
    assert overview["rows"][0]["heads"][2]["type"] == "previous-token"


@pytest.mark.hf
def test_minilm_maps_when_asked(minilm_runs):
    maps = minilm_runs["maps"].stdout
    assert "L0 · head 0" in maps and "head statistics" in maps and "overview" not in maps
    layer = minilm_runs["layer"].stdout
    assert "L0 · head 2" in layer and "L1 · head" not in layer and "overview" not in layer


@pytest.mark.hf
def test_encoder_decoder_overview_groups_stacks(cli):
    pytest.importorskip("transformers")
    result = cli("heatmap", "--model", SAMPLE_MARIAN, "the cat sat on the mat", "--target",
                 "a dog ran", "--overview", "previous", env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    labels = [m.group(1) for m in re.finditer(r"^\s*((?:enc|dec|cross) \d)\s", result.stdout,
                                                re.M)]
    assert labels == ["enc 0", "enc 1", "dec 0", "dec 1", "cross 0", "cross 1"]
    cross = next(line for line in result.stdout.splitlines() if line.startswith("cross 0"))
    assert cross.split()[2:] == ["–"] * 4  # no previous token across sequences


def test_colour_repeats_the_words_and_does_not_dim_cells():
    out = io.StringIO()
    print_overview(Console(file=out, width=80, color_system="truecolor", force_terminal=True),
                   grid(1, 3))
    text = out.getvalue()
    assert "\x1b[36m prev" in text  # previous-token heads in cyan, not dimmed by the row label
    assert re.sub(r"\x1b\[[0-9;]*m", "", text) == render(grid(1, 3))  # same words either way
