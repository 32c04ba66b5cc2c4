"""Sensible volume: --quiet prints only what was written; writing a file turns the terminal
maps off unless --maps asks for them; --head filters the statistics too."""

from __future__ import annotations

import json

import pytest
from helpers import assert_clean_error

SENTENCE = "the cat sat on the mat the cat sat"


def test_quiet_prints_only_the_files_written(cli, tmp_path):
    out, export = tmp_path / "m.png", tmp_path / "m.safetensors"
    result = cli("heatmap", SENTENCE, "--out", out, "--export", export, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"wrote {out}", f"wrote {export}"]
    assert result.stderr == ""
    assert out.exists() and export.exists()


def test_quiet_without_files_is_refused(cli, tmp_path):
    """A run that would show nothing and write nothing drops every option it was given."""
    assert_clean_error(cli("heatmap", SENTENCE, "--quiet"), 2, "no file is written",
                       "add --out, --html or --export, or drop --quiet")
    # control: with a file to write, --quiet prints the one 'wrote' line
    result = cli("heatmap", SENTENCE, "--quiet", "--export", tmp_path / "m.safetensors")
    assert result.exit_code == 0 and result.stdout.startswith("wrote"), result.output


def test_quiet_refuses_what_only_the_terminal_would_show(cli, tmp_path):
    """--query's breakdown is printed or put on the --html page: beside --quiet and an --export
    alone, it would be dropped."""
    export = tmp_path / "m.safetensors"
    assert_clean_error(cli("heatmap", SENTENCE, "--quiet", "--export", export, "--query", "mat"),
                       2, "--quiet prints no maps or tables", "drop --quiet or --query")
    assert not export.exists()
    # control: where the page shows it, it applies
    result = cli("heatmap", SENTENCE, "--quiet", "--html", tmp_path / "m.html", "--query", "mat")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_quiet_ablate_needs_the_figure(cli, tmp_path, mode):
    """The scorecard is printed, or drawn with --out: --quiet without --out would drop it."""
    assert_clean_error(cli("ablate", SENTENCE, "--quiet", "--mode", mode), 2,
                       "without --out the scorecard is only printed", "add --out")
    assert list(tmp_path.iterdir()) == []
    # control: with --out, --quiet prints only the 'wrote' lines
    result = cli("ablate", SENTENCE, "--quiet", "--mode", mode, "--out", tmp_path / "m.png")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ablation.png", "m.png"]
    assert all(line.startswith("wrote") for line in result.stdout.splitlines())


@pytest.mark.parametrize("flag", ["--maps", "--stats", "--rank"])
def test_quiet_refuses_flags_that_ask_for_tables(cli, flag):
    assert_clean_error(cli("heatmap", SENTENCE, "--quiet", flag), 2, "--quiet prints no maps",
                       f"drop --quiet or {flag}")


@pytest.mark.parametrize("option,suffix", [("--out", "m.png"), ("--export", "m.safetensors"),
                                           ("--html", "m.html")])
def test_writing_a_file_turns_terminal_maps_off_unless_asked(cli, tmp_path, option, suffix):
    path = tmp_path / suffix
    quiet_maps = cli("heatmap", SENTENCE, option, path)
    assert quiet_maps.exit_code == 0, quiet_maps.output
    assert "L0 · head 0" not in quiet_maps.stdout
    assert "--maps prints them here too" in quiet_maps.stdout
    assert "head statistics" in quiet_maps.stdout and f"wrote {path}" in quiet_maps.stdout
    loud = cli("heatmap", SENTENCE, option, path, "--maps")
    assert "L0 · head 0" in loud.stdout and "--maps prints them" not in loud.stdout
    assert "L0 · head 0" in cli("heatmap", SENTENCE).stdout  # no file: maps by default


def test_head_filters_the_statistics(cli):
    result = cli("heatmap", SENTENCE, "--head", "1", "--no-maps")
    assert result.exit_code == 0, result.output
    table = result.stdout.split("head statistics", 1)[1].splitlines()
    rows = [line.split() for line in table if line[:5].strip().isdigit()]
    assert [(row[0], row[1]) for row in rows] == [("0", "1"), ("1", "1")]
    doc = json.loads(cli("heatmap", SENTENCE, "--head", "1", "--json").stdout)
    assert [(s["layer"], s["head"]) for s in doc["head_stats"]] == [(0, 1), (1, 1)]
