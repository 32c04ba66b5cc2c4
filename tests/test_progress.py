"""Progress on stderr: the app reports its steps through a plain callback; the CLI shows them
beside a spinner only when stderr is a terminal, and never under --json."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from attnviz.app.heatmap import HeatmapRequest, run_heatmap
from attnviz.cli import progress as progress_mod
from attnviz.core.request import RandomSpec

ROOT = Path(__file__).resolve().parents[1]


def test_the_app_reports_its_steps_through_a_callback():
    heard: list[str] = []
    run_heatmap(HeatmapRequest.build(sentences=("a b c", "d e"), random=RandomSpec(16, 2)),
                heard.append)
    assert heard == ["running attention on 2 sentences (5 tokens)", "computing head statistics"]


def test_the_app_layer_stays_free_of_rich():
    for path in (ROOT / "attnviz" / "app").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.split(".")[0] == "rich" for name in names), path


def test_silent_when_stderr_is_not_a_terminal(cli, tmp_path):
    result = cli("heatmap", "--random", "a b c", "--out", tmp_path / "m.png")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


@pytest.fixture
def terminal(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(progress_mod, "stderr_console",
                        lambda: Console(file=buffer, force_terminal=True, width=80))
    return buffer


def test_a_terminal_sees_a_spinner_that_is_cleared(cli, tmp_path, terminal):
    result = cli("heatmap", "--random", "a b c", "--out", tmp_path / "m.png")
    assert result.exit_code == 0, result.output
    shown = terminal.getvalue()
    assert "running attention on 1 sentence (3 tokens)" in shown
    assert "drawing the figure m.png" in shown
    assert shown.rstrip().endswith("\x1b[2K")  # transient: the last line is erased
    assert "running attention" not in result.stdout  # stdout (maybe a pipe) never gets it


def test_json_runs_stay_silent_even_on_a_terminal(cli, terminal):
    result = cli("heatmap", "--random", "a b c", "--json")
    json.loads(result.stdout)
    assert terminal.getvalue() == ""


def test_a_failure_stops_the_spinner_and_prints_one_error(cli, tmp_path, terminal):
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = torch.nn.MultiheadAttention(16, 4).state_dict()
    state["in_proj_weight"][0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(state, str(path), metadata={"num_heads": "4"})
    result = cli("heatmap", "--weights", path, "a b c")
    assert result.exit_code == 1
    assert result.stderr.count("error: ") == 1
    assert "running attention" in terminal.getvalue()
    assert terminal.getvalue().rstrip().endswith("\x1b[2K")
