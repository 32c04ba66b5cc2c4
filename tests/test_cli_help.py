"""--help for people: examples that run as shown, no `<bool>` placeholders, text that is not
eaten as markup, and lines that fit an 80-column terminal."""

from __future__ import annotations

import shlex

import pytest
from helpers import ROOT, needs_safe_pickles

from attnviz.cli.examples import EXAMPLES
from attnviz.load.pickles import PICKLE_SUFFIXES

COMMANDS = ["split", "inspect", "heatmap", "generate", "ablate", "circuits", "patch",
            "attribute", "lens", "tokens", "corpus", "compare"]


def _example(example: str):
    """An example that opens a torch pickle runs where torch >= 2.10 (refused below, by design);
    one that runs a Hugging Face model (`--model`, `-m`) needs the hf extra."""
    words = shlex.split(example)
    opens_pickle = any(word.endswith(PICKLE_SUFFIXES) for word in words)
    marks = [needs_safe_pickles] if opens_pickle else []
    if "--model" in words or "-m" in words:
        marks.append(pytest.mark.hf)
    return pytest.param(example, id=example[:60], marks=marks)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_runnable_looking_examples(cli, command):
    result = cli(command, "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0
    text = result.stdout
    assert "Examples" in text
    for example, _ in EXAMPLES[command]:
        assert example in text.replace("\n ", " ") or example.split()[2] in text
    assert "<bool>" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_markup_in_help_text_is_shown_as_typed(cli):
    result = cli("heatmap", "--help", env={"COLUMNS": "200"})
    assert "attnviz[hf]" in result.stdout  # not eaten as a rich markup tag


@pytest.mark.parametrize("example", [_example(e) for c in COMMANDS for e, _ in EXAMPLES[c]])
def test_every_help_example_runs(cli, tmp_path, example):
    """Sample paths are relative to a clone's root; outputs go to a scratch folder."""
    words = [str(ROOT / w) if w.startswith("sample_weights") else
             str(tmp_path / w) if w.endswith(".png") else w for w in shlex.split(example)[1:]]
    result = cli(*words)
    assert result.exit_code == 0, (example, result.output)


def test_bare_attnviz_prints_help_and_no_empty_error():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "attnviz"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert "Usage" in result.stdout + result.stderr
    assert "error:" not in result.stdout + result.stderr


@pytest.mark.parametrize("args", [["heatmap", "the cat sat on the mat"], ["split"],
                                  ["inspect", "sample_weights/llama-gqa-tiny"]])
@pytest.mark.slow
def test_a_closed_pipe_exits_0_quietly(args):
    """`attnviz … | head -1`: the reader closing the pipe early is a success, and silent."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "attnviz", *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert stderr == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_sits_in_a_panel(command):
    """A new option is placed in attnviz/cli/panels.py's table, or this fails."""
    import typer

    from attnviz.cli.main import app
    from attnviz.cli.panels import unplaced

    built = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    assert unplaced(command, built) == []


def test_the_panel_check_can_fail():
    import typer

    from attnviz.cli.main import app
    from attnviz.cli.panels import PANELS, unplaced

    built = typer.main.get_command(app).commands["heatmap"]  # type: ignore[attr-defined]
    table = dict(PANELS["heatmap"])
    del table["budget"]
    original = PANELS["heatmap"]
    PANELS["heatmap"] = table
    try:
        assert unplaced("heatmap", built) == ["budget"]
    finally:
        PANELS["heatmap"] = original


@pytest.mark.parametrize("command", COMMANDS)
def test_help_groups_options_and_shows_examples_on_its_first_screen(cli, command):
    text = cli(command, "--help", env={"COLUMNS": "80"}).stdout
    first_screen = "\n".join(text.splitlines()[:24])
    assert "For example" in first_screen
    assert EXAMPLES[command][0][0] in first_screen
    panels = [line.split("─ ")[1].split(" ─")[0] for line in text.splitlines()
              if line.startswith("╭─ ")]
    assert "Options" not in panels  # every option is in a named panel
    assert panels[-1] == "Help"
    assert {"Source", "Outputs"} <= set(panels) or command == "inspect"


def test_attnviz_help_lists_the_verbs(cli):
    text = cli("--help", env={"COLUMNS": "100"}).stdout
    listed = [line.split()[1] for line in text.splitlines()
              if line.startswith("│ ") and len(line.split()) > 1 and line.split()[1] in COMMANDS]
    assert listed == COMMANDS  # in this order; the control: a name no command has is absent
    assert "trace" not in listed and "flow" not in listed


# options the generation and scorecard commands declare for themselves: what they mean there
# differs (the draw's seed, the scorecard's figure and ranking, its heads scored one by one:
# no mean of heads)
OWN = {("generate", "seed"), ("ablate", "out"), ("ablate", "rank"), ("ablate", "head")}


@pytest.mark.parametrize("command", ["generate", "ablate"])
def test_shared_options_are_heatmaps_own(command):
    """Every option generate and ablate share with heatmap is the same declaration: same flags,
    help and panel; and each command keeps to about 30 options (heatmap's jobs moved out)."""
    import typer.main

    from attnviz.cli.main import app
    from attnviz.cli.panels import PANELS

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    heatmap = {p.name: p for p in commands["heatmap"].params}
    params = [p for p in commands[command].params if p.name != "help" and not p.hidden]
    shared = [p for p in params if p.name in heatmap and (command, p.name) not in OWN]
    assert len(shared) >= 20
    for param in shared:
        twin = heatmap[param.name]
        assert param.opts == twin.opts, param.name
        assert getattr(param, "help", None) == getattr(twin, "help", None), param.name
        assert PANELS[command][param.name] == PANELS["heatmap"][param.name], param.name
    assert len(params) <= 30, len(params)
    assert len([p for p in heatmap.values() if not p.hidden]) <= 30
    # control: generate's --seed is its own (the draw's); heatmap's random init is seeded by
    # --spec seed=, and heatmap has no --seed but the hidden old spelling
    if command == "generate":
        seed = next(p for p in params if p.name == "seed")
        assert "--sample" in seed.help and heatmap["old_seed"].hidden


def test_heatmap_lists_no_generation_or_scorecard_option(cli):
    text = cli("heatmap", "--help", env={"COLUMNS": "200"}).stdout
    for flag in ("--generate", "--sample", "--temperature", "--top-p", "--ablate ",
                 "--ablate-mean", "proof batch"):
        assert flag not in text, flag
    assert "seed (of the random init, default 0)" in text
