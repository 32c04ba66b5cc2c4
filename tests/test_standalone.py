"""A standalone --weights layer says plainly what its maps are: synthetic inputs, not the model's
hidden states (and --model when the folder can run as a model); -H that contradicts the
checkpoint warns; maps, statistics and exports carry the layer's real index."""

from __future__ import annotations

import json

import pytest
from helpers import SAMPLES
from safetensors import safe_open


def _notes(stdout: str) -> str:
    """The header (up to the first blank line), its lines joined."""
    return " ".join(stdout.split("\n\n", 1)[0].split())


def _squeezed(text: str) -> str:
    return "".join(text.split())  # a long path may be folded anywhere


def test_header_says_the_inputs_are_synthetic_and_suggests_model(cli, minilm):
    result = cli("heatmap", "--weights", minilm, "--layer", "3", "the cat sat", "--no-maps",
                 "--no-stats")
    assert result.exit_code == 0, result.output
    header = _notes(result.stdout)
    assert "synthetic inputs" in header
    assert "not to the hidden states the model feeds that layer" in header
    assert _squeezed(f"attnviz heatmap --model {minilm} …") in _squeezed(header)
    assert result.stderr == ""


def test_a_bare_layer_file_gets_no_model_suggestion(cli):
    result = cli("heatmap", "--weights", SAMPLES / "mha.safetensors", "a b c", "--no-maps")
    assert result.exit_code == 0, result.output
    header = _notes(result.stdout)
    assert "synthetic inputs" in header and "--model" not in header


def test_random_and_bundled_runs_have_no_synthetic_note(cli):
    for args in (["--random"], []):
        result = cli("heatmap", *args, "a b c", "--no-maps")
        assert "synthetic inputs" not in result.stdout


@pytest.mark.parametrize("heads,warned", [("4", True), ("12", False), (None, False)])
def test_heads_that_disagree_with_config_warn_on_stderr(cli, minilm, heads, warned):
    result = cli("heatmap", "--weights", minilm, "--layer", "2", "the cat sat", "--no-maps",
                 *(["-H", heads] if heads else []))
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    if warned:
        assert len(lines) == 1 and lines[0].startswith("warning: -H 4 disagrees with "
                                                        "config.json's num_attention_heads = 12")
    else:
        assert lines == []
    # --json stays one clean document on stdout; the warning still goes to stderr
    doc = cli("heatmap", "--weights", minilm, "--layer", "2", "the cat sat", "--json",
              *(["-H", heads] if heads else []))
    json.loads(doc.stdout)
    assert ("warning:" in doc.stderr) is warned


def test_panels_statistics_and_exports_use_the_real_layer_index(cli, tmp_path, minilm):
    result = cli("heatmap", "--weights", minilm, "--layer", "3", "the cat sat", "--head", "0")
    assert result.exit_code == 0, result.output
    assert "L3 · head 0" in result.stdout and "L0 · head" not in result.stdout
    table = result.stdout.split("head statistics", 1)[1].splitlines()
    rows = [line.split() for line in table if line[:5].strip().isdigit()]
    assert rows and all(row[0] == "3" for row in rows)
    doc = json.loads(cli("heatmap", "--weights", minilm, "--layer", "-3", "a b", "--json").stdout)
    assert doc["layers"][0]["index"] == 3 and {s["layer"] for s in doc["head_stats"]} == {3}
    path = tmp_path / "maps.safetensors"
    assert cli("heatmap", "--weights", minilm, "--layer", "3", "a b", "--export", path,
               "--no-stats").exit_code == 0
    with safe_open(str(path), "pt") as f:
        assert {"attn.3", "inputs.3", "mask"} == set(f.keys())


def test_streamed_standalone_layers_are_renumbered_too(cli, minilm, monkeypatch):
    from attnviz.core import memory

    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    result = cli("heatmap", "--weights", minilm, "--layer", "4", "the cat sat on the mat",
                 "--head", "1", "--json")
    doc = json.loads(result.stdout)
    assert doc["layers"][0]["method"].startswith("explicit per head, streamed")
    assert {s["layer"] for s in doc["head_stats"]} == {4}
    shown = cli("heatmap", "--weights", minilm, "--layer", "4", "the cat sat on the mat",
                "--head", "1", "--no-stats")
    assert "L4 · head 1" in shown.stdout
