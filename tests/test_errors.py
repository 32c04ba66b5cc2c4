"""The error model: neutral facts with keyword-only fix/where/option, one line, one exit code
per kind of mistake."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from attnviz.errors import (
    AttnvizError,
    CheckpointError,
    ExitCode,
    UsageError,
    printable,
    quoted,
    with_options,
)


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        UsageError("what", "a positional fix")  # type: ignore[misc]
    error = UsageError("head 9 is out of range", fix="choose 0..7", option="head")
    assert (error.what, error.fix, error.option, error.where) == (
        "head 9 is out of range", "choose 0..7", "head", "")


@pytest.mark.parametrize("kwargs, line", [
    ({}, "it broke"),
    ({"fix": "do this"}, "it broke — do this"),
    ({"where": "a/b.safetensors"}, "it broke (a/b.safetensors)"),
    ({"option": "layer", "where": "ckpt", "fix": "x"}, "it broke (layer; ckpt) — x"),
])
def test_one_line(kwargs, line):
    assert AttnvizError("it broke", **kwargs).one_line() == line


def test_one_line_folds_newlines_from_files():
    assert "\n" not in CheckpointError("bad\nname", where="dir\n/x").one_line()


def test_exit_codes():
    assert UsageError("x").exit_code == ExitCode.USAGE == 2
    assert CheckpointError("x").exit_code == ExitCode.DATA == 1


# --- option references: the library never names a command-line flag -----------------------

LIBRARY = ("core", "load", "recognize", "compute", "sources", "app")
PACKAGE = Path(__file__).resolve().parents[1] / "attnviz"
FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _error_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    return name.endswith("Error")


def flagged(source: str) -> list[str]:
    """Strings inside raise statements and error constructors that name a flag, and `option=`
    values that are not request-field names."""
    found: dict[int, str] = {}  # by node: a raise holds its error's call, seen twice
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Raise) or _error_call(node)):
            continue
        options = {id(sub.value) for sub in ast.walk(node)
                   if isinstance(sub, ast.keyword) and sub.arg == "option"}
        for sub in ast.walk(node):
            if not (isinstance(sub, ast.Constant) and isinstance(sub.value, str)):
                continue
            if id(sub) in options:
                if not re.fullmatch(r"[a-z][a-z0-9_]*", sub.value):
                    found[id(sub)] = f"option={sub.value!r}"
            elif FLAG.search(sub.value):
                found[id(sub)] = sub.value
    return list(found.values())


def test_the_flag_scan_finds_flags():
    """Negative control: the scan below does see a flag in an error and a flag as option."""
    assert flagged('raise UsageError("use --layer 2", option="--layer")') == [
        "use --layer 2", "option='--layer'"]
    assert flagged('raise UsageError("use \u2039layer\u203a 2", option="layer")') == []


def test_library_errors_refer_to_options_neutrally():
    offenders = [f"{path.relative_to(PACKAGE)}: {text}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 if path.relative_to(PACKAGE).parts[0] in LIBRARY
                 for text in flagged(path.read_text())]
    assert offenders == []


def test_the_cli_shows_flags_and_python_callers_keywords(cli):
    import attnviz

    result = cli("heatmap", "--random", "a b c d", "--budget", "tokens=2")
    assert result.exit_code == 2 and "more than --budget tokens 2" in result.stderr
    with pytest.raises(UsageError) as info:
        attnviz.run_heatmap(["a b c d"], random=True, max_tokens=2)
    assert "more than max_tokens 2" in str(info.value)
    assert "--" not in info.value.one_line()


def test_text_from_a_file_cannot_forge_a_reference():
    forged = printable("\u2039max_tokens\u203a")
    assert "\u2039" not in forged and with_options(forged, lambda n: "--" + n) == forged
    error = CheckpointError(f"bad name {quoted(chr(0x2039) + 'x' + chr(0x203a))}",
                            option="max_tokens")
    assert error.one_line(lambda n: "--" + n.replace("_", "-")).endswith("(--max-tokens)")
    assert "--x" not in error.one_line(lambda n: "--" + n)


def test_option_fields_are_names_everywhere(cli):
    """`option=` holds a request field's name in every layer, the CLI included: the CLI adds the
    dashes when it prints (a flag there printed as '----num-heads')."""
    offenders = [f"{path.relative_to(PACKAGE)}: {text}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for text in flagged(path.read_text()) if text.startswith("option=")]
    assert offenders == []
    result = cli("heatmap", "--random", "-H", "0", "a b")
    assert result.exit_code == 2 and "(--num-heads)" in result.stderr
    assert "---" not in result.stderr


# --- notes, not only errors: library text refers to options neutrally ----------------------

# Library text that still names a flag, each on the inspect path or a command suggestion: the
# list may only shrink (an entry that no longer matches fails too).
STILL_NAMING_FLAGS = {
    "app/standalone.py": "; for that, run the model: attnviz heatmap --model ",  # a command
    "recognize/conventions.py": "timm stores no head count: pass --num-heads",
    "recognize/match.py": "pass --num-heads, or open the model folder",
}


def flagged_text(source: str) -> list[str]:
    """Every string constant (docstrings aside) that names a flag."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and FLAG.search(node.value)]


def test_the_text_scan_finds_flags_in_notes():
    """Negative control: a note (no error in sight) naming a flag is seen; a docstring is not."""
    assert flagged_text('"""Docs may say --export."""\nNOTE = "use --positions x"') == [
        "use --positions x"]
    assert flagged_text('NOTE = "use \u2039positions\u203a x"') == []


def test_library_notes_refer_to_options_neutrally():
    found = {str(path.relative_to(PACKAGE)): text
             for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] in LIBRARY
             for text in flagged_text(path.read_text())}
    assert sorted(found) == sorted(STILL_NAMING_FLAGS)
    for path, start in STILL_NAMING_FLAGS.items():
        assert found[path].startswith(start), path


def test_the_cli_shows_a_note_with_flags_and_the_api_with_keywords(cli):
    import attnviz

    words = " ".join(f"w{i}" for i in range(300))
    result = cli("heatmap", "--random", words, "--budget", "tokens=400", "--budget", "memory=1MB")
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())  # the terminal folds long lines
    assert "; --export writes the full maps block by block" in shown
    assert "\u2039" not in result.stdout
    page = attnviz.run_heatmap(["a b c"], random=True, weighting="norm").html()
    assert "statistics, overview and rank read these maps; export holds" in page
    assert "\u2039" not in page and "--rank" not in page


@pytest.mark.hf
@pytest.mark.slow
def test_json_notes_show_flags_at_any_depth(cli, tmp_path):
    """--json shows a note's option references as flags wherever the note sits (here the
    scorecard's `ablation_run.notes`: an encoder-decoder without --target), as the terminal
    does; text outside notes is data and kept as it is."""
    import json

    import zoo

    from attnviz.cli.options import notes_with_flags

    folder = zoo.build_lm("t5", tmp_path / "t5")
    result = cli("ablate", "--model", folder, "the cat sat", "--layer", "enc 0", "--json")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["ablation_run"]["notes"]
    assert any("without --target" in note for note in notes), notes
    assert "\u2039" not in result.stdout and "\\u2039" not in result.stdout
    # control: the same document before the CLI's conversion holds the neutral marker
    marker = {"ablation_run": {"notes": ["without \u2039target\u203a"]},
              "tokens": ["\u2039a\u203a"]}
    assert notes_with_flags(marker) == {"ablation_run": {"notes": ["without --target"]},
                                        "tokens": ["\u2039a\u203a"]}


def typed_markers(source: str) -> list[str]:
    """String constants (docstrings aside) holding a hand-typed ‹name› marker: every library
    message refers to an option through errors.option(name), the one spelling the CLI maps."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and "\u2039" in node.value and id(node) not in docstrings]


def test_the_marker_scan_finds_typed_markers():
    """Negative control: a typed marker is seen; errors.option() and a docstring are not."""
    typed = "drop \u2039ablate\u203a"
    assert typed_markers(f'raise UsageError("{typed}")') == [typed]
    assert typed_markers('raise UsageError(f"drop {option(\'ablate\')}")') == []
    assert typed_markers('def f():\n    """the \u2039max_tokens\u203a marker"""\n') == []


def test_library_messages_use_errors_option_for_every_option_name():
    offenders = [f"{path.relative_to(PACKAGE)}: {text}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 if path.name != "errors.py"  # where option() writes the marker
                 for text in typed_markers(path.read_text())]
    assert offenders == []


@pytest.mark.parametrize("torch_version", ["2.9.1", None])  # None: the installed torch
def test_old_torch_refuses_pickles(cli, tmp_path, monkeypatch, torch_version):
    """Below torch 2.10 a pickle checkpoint is refused in one line naming both versions. Faked
    on a newer torch; the installed one at CI's core-floor job (torch 2.1), where it is real."""
    import torch
    from helpers import assert_clean_error, torch_loads_pickles

    path = tmp_path / "mha.pt"
    torch.save(torch.nn.MultiheadAttention(8, 2).state_dict(), path)
    if torch_version is not None:
        monkeypatch.setattr(torch, "__version__", torch_version)
    elif torch_loads_pickles():  # the control: a torch >= 2.10 opens the same file
        assert cli("inspect", path, "-H", "2").exit_code == 0
        return
    assert_clean_error(cli("inspect", path, "-H", "2"), 1,
                       "needs torch >= 2.10, this is 2.", "convert the checkpoint to .safetensors")


def test_a_model_the_scorecard_cannot_edit_points_to_the_maps_alone():
    """The library's "drop ‹ablate›" read "drop 'attnviz ablate'" inside `attnviz ablate`, the
    command itself; there it now names the command for the maps alone, while the API keeps its
    keyword and other commands their own spelling."""
    from attnviz.cli.compound import spell_as
    from attnviz.cli.options import flag_of
    from attnviz.errors import CheckpointError, option

    error = CheckpointError("the scorecard cannot run", fix=f"drop {option('ablate')}")
    token = spell_as("ablate")
    try:
        shown = error.one_line(flag_of)
    finally:
        spell_as(None, token)
    assert shown.endswith("— drop 'attnviz ablate' (run 'attnviz heatmap' for the maps alone)")
    assert error.one_line().endswith("— drop ablate")  # the API: its keyword
    assert error.one_line(flag_of).endswith("— drop 'attnviz ablate'")  # control: outside it
