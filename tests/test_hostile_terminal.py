"""Hostile text never reaches the terminal as a control sequence: names, paths, option
values, sentence files, tokens and random strings through every printer are escaped, and colours
come only from attnviz.

The contract every case asserts is in tests/hostile.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hostile import (
    CONTROLS,
    MARKUP,
    assert_error,
    assert_no_control,
    assert_printed_clean,
    digest,
    mha_state,
    one_thread,  # noqa: F401 - autouse: torch on one thread
    write_named,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnviz.errors import one_line, printable

# ------------------------------------------------------------------------------------------
# 2. Nothing reaches the terminal as a control sequence

# random text built from what a terminal interprets and markup that must stay literal
HOSTILE = st.lists(st.sampled_from(CONTROLS + MARKUP) | st.text(max_size=4), min_size=1,
                   max_size=5).map("".join)


@pytest.mark.parametrize("text", CONTROLS + MARKUP + ["\ud800", "a\nb", "x" * 5000])
def test_printable_escapes_everything_a_terminal_interprets(text):
    shown = printable(text, None)
    assert_no_control(shown)
    assert printable(shown, None) == shown  # idempotent: escaping twice changes nothing
    line = one_line(f"what {text} — fix")
    assert_no_control(line)
    assert "\n" not in line and len(line) <= 1000


def test_the_console_escapes_what_a_renderer_missed():
    """The last line of defence: plain strings, table cells and Text given to attnviz's
    console come out escaped, markup and emoji codes literal."""
    import io

    from rich.table import Table
    from rich.text import Text

    from attnviz.render.safe import console

    out = console()
    out.file = io.StringIO()
    table = Table()
    table.add_column("[bold]name[/]")
    table.add_row("x\x1b[2J[red]y", Text("\x1b]0;t\x07\u202ez"))
    out.print(table)
    out.print("wrote [/] :smile: \x9b31m \u2066")
    text = out.file.getvalue()
    assert_no_control(text)
    assert "[bold]name[/]" in text and "[/] :smile:" in text and "\\x1b[2J[red]y" in text


@pytest.fixture(scope="module")
def hostile_checkpoint(tmp_path_factory) -> Path:
    """Tensor names, config values and metadata full of escapes and markup."""
    folder = tmp_path_factory.mktemp("hostile") / "model"
    folder.mkdir()
    name = "\x1b[2J\x1b]0;t\x07[bold]\u202eevil[/]\x9b31m"
    tensors = {**mha_state(prefix=name + ".self_attn."),
               **{f"blk.\x07{i}\u2066.attn.qkv.weight": torch.zeros(12, 4) for i in range(2)},
               **{f"blk.\x07{i}\u2066.attn.proj.weight": torch.zeros(4, 4) for i in range(2)},
               "other\x1b[5m.attention.thing": torch.zeros(2)}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):  # a layer that reads config.json
        tensors[f"model.layers.0.self_attn.{proj}.weight"] = torch.zeros(4, 4)
    write_named(folder / "model.safetensors", tensors, {"num_heads": "2"})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mistral", "num_attention_heads": 2,
        "sliding_window": "\x1b[5m[blink]\u202e", "attn_logit_softcapping": "\x07"}))
    return folder


SPLIT_INSPECT_CASES = [
    ("inspect", lambda d: ["inspect", d]),
    ("inspect --layer", lambda d: ["inspect", d, "--layer", "0", "-H", "2"]),
    ("inspect --scan", lambda d: ["inspect", d, "--scan", "-H", "2"]),
    ("inspect --json", lambda d: ["inspect", d, "--json"]),
    ("split", lambda d: ["split", "--weights", d, "--layer", "0", "-H", "2"]),
    ("split --json", lambda d: ["split", "--weights", d, "--layer", "-1", "-H", "2", "--json"]),
    ("heatmap", lambda d: ["heatmap", "--weights", d, "--layer", "-1", "-H", "2",
                           "a [b] \x1b[2J c"]),
    ("inspect notes from config values", lambda d: ["inspect", d, "--layer", "1"]),
]


@pytest.mark.parametrize("case", SPLIT_INSPECT_CASES, ids=[c[0] for c in SPLIT_INSPECT_CASES])
def test_hostile_names_print_escaped(cli, hostile_checkpoint, case):
    before = digest(hostile_checkpoint)
    result = cli(*case[1](hostile_checkpoint))
    assert_printed_clean(result)
    if "--json" in case[0]:
        json.loads(result.stdout)
    else:
        assert "[bold]" in result.stdout or "heatmap" in case[0]  # markup shown, not applied
        assert "\\x1b" in result.stdout
    if case[0] == "inspect notes from config values":
        # the malformed value is named in a note, escaped (inspect does not compute with it)
        assert "sliding_window' is '\\x1b[5m[blink]\\u202e'" in " ".join(result.stdout.split())
    assert digest(hostile_checkpoint) == before


def test_hostile_layer_name_in_an_error(cli, hostile_checkpoint):
    assert_error(cli("inspect", hostile_checkpoint, "--layer", "\x1b]0;x\x07[/]"), 2,
                 "no attention layer named", "\\x1b]0;x\\x07[/]")


@pytest.mark.parametrize("value", ["\x1b[2J", "\u202e7", "[/]"])
def test_hostile_option_values_in_click_errors(cli, value):
    assert_error(cli("split", "-H", value), 2, "--num-heads")


@pytest.mark.slow
def test_hostile_paths_in_wrote_lines_and_errors(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    weird = tmp_path / "d\x1b[2J[bold]\u202e$\\frac{x}"
    weird.mkdir()
    out, export = weird / "f[red]\x07.png", weird / "m\x9b.safetensors"
    result = cli("heatmap", "--random", "a b", "--out", out, "--export", export, "--no-maps")
    assert_printed_clean(result)
    assert result.stdout.count("wrote ") == 2 and "[bold]" in result.stdout
    assert out.stat().st_size > 0 and export.stat().st_size > 0
    assert_error(cli("inspect", weird / "missing\x1b.safetensors"), 2, "no such file",
                 "missing\\x1b")
    png = weird / "s$\\frac{.png"
    assert_printed_clean(cli("split", "--png", png))  # mathtext in the title is drawn as text
    assert sorted(p.name for p in weird.iterdir()) == sorted([out.name, export.name, png.name])


def test_sentence_file_lines_print_escaped(cli, tmp_path):
    lines = tmp_path / "s.txt"
    lines.write_text("one \x1b]8;;http://x\x07link two\nthree [red]four\u2066\n")
    result = cli("heatmap", "--random", "-f", lines, "--query", "\x1b")
    assert_printed_clean(result)
    assert "[red]" in result.stdout


def test_colours_come_only_from_attnviz(cli, monkeypatch):
    """On a colour terminal the only escape sequences are rich's own colours (SGR)."""
    import re

    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm-256color")
    result = cli("heatmap", "--random", "\x1b]0;x\x07 \x1b[2J \x9b2J a")
    assert result.exit_code == 0, result.output
    assert "\x1b[" in result.stdout  # the maps are coloured
    assert_no_control(re.sub(r"\x1b\[[0-9;]*m", "", result.stdout))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.slow
@given(sentence=HOSTILE, name=HOSTILE, path=HOSTILE)
def test_every_printer_escapes_random_strings(cli, tmp_path_factory, sentence, name, path):
    """Random control-laden strings as a sentence, a tensor name and a path, through split,
    inspect, heatmap (terminal, --query, --json, wrote lines) and errors."""
    folder = tmp_path_factory.mktemp("prop")
    words = sentence if any(ch.isalnum() for ch in sentence) else sentence + " w"
    file_name = "".join(ch for ch in path if ch not in "/\x00" and not
                        0xD800 <= ord(ch) <= 0xDFFF)[:40]
    checkpoint = folder / "w.safetensors"
    write_named(checkpoint, mha_state(prefix=name + "."))
    runs = [  # sentences after `--`: they may start with "-"
        cli("heatmap", "--random", "--export", folder / f"{file_name}.safetensors", "--", words),
        cli("heatmap", "--random", "--json", "--query", "0", "--", words),
        cli("heatmap", "--random", f"--query={sentence or 'x'}", "--", words),
        cli("inspect", checkpoint, "-H", "2", "--layer", "0"),
        cli("split", "--weights", checkpoint, "-H", "2"),
        cli("split", "--weights", checkpoint, "--layer", name),
        cli("inspect", folder / f"{file_name}.missing"),
    ]
    for result in runs:
        assert result.exit_code in (0, 1, 2), result.output
        assert "Traceback" not in result.output
        assert_no_control(result.stdout, result.stderr)
        if result.exit_code:
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    json.loads(runs[1].stdout)
