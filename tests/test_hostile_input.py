"""Hostile input, second round: what reaches the terminal, what sizes the work, how inputs are
read, how third-party failures surface, and the error contract.

Every case asserts the exit code, the one-line message fragment that proves the right check
fired, no traceback, no control character in stdout or stderr, inputs unchanged and no leftover
files; memory caps are enforced with RLIMIT_AS in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import assert_clean_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnviz.errors import one_line, printable

# Everything a terminal could interpret: C0 and C1 controls, ESC sequences (CSI, OSC), DEL,
# bidi overrides and isolates; and rich markup / emoji codes that must stay literal.
CONTROLS = ["\x1b[31m", "\x1b[2J", "\x1b]0;pwned\x07", "\x07", "\x00", "\x08", "\r", "\x7f",
            "\x9b31m", "\x85", "\x90", "\u202e", "\u202a", "\u2066", "\u2069", "\u200f",
            "\u2028", "\ufeff"]
MARKUP = ["[bold]", "[/]", "[red on white]", ":smile:", "$\\frac{", "[link=x]y[/link]"]
HOSTILE = st.lists(st.sampled_from(CONTROLS + MARKUP) | st.text(max_size=4), min_size=1,
                   max_size=5).map("".join)


def assert_no_control(*texts: str) -> None:
    """No character a terminal interprets: only printable text and newlines."""
    for text in texts:
        bad = sorted({ch for ch in text if ch != "\n" and not ch.isprintable()})
        assert not bad, (bad, text[:400])


def assert_printed_clean(result, code: int = 0) -> None:
    assert result.exit_code == code, (result.exit_code, result.output[-2000:])
    assert "Traceback" not in result.output
    assert_no_control(result.stdout, result.stderr)


def assert_error(result, code: int, *fragments: str) -> None:
    assert_clean_error(result, code, *fragments)
    assert_no_control(result.stdout, result.stderr)


def digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` by name and content: inputs unchanged, nothing left over."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink() and p.exists()}


def st_bytes(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + data


def mha_state(embed: int = 8, heads: int = 2, prefix: str = "") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = torch.nn.MultiheadAttention(embed, heads).state_dict()
    return {prefix + k: v.contiguous() for k, v in state.items()}


def write_named(path: Path, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written by hand, so names may hold anything JSON can (lone
    surrogates included, which the library's writer cannot encode)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    data, offset = b"", 0
    for name, tensor in tensors.items():
        raw = tensor.to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    path.write_bytes(st_bytes(json.dumps(header).encode(), data))


# ------------------------------------------------------------------------------------------
# 2. Nothing reaches the terminal as a control sequence


@pytest.mark.parametrize("text", CONTROLS + MARKUP + ["\ud800", "a\nb", "x" * 5000])
def test_printable_escapes_everything_a_terminal_interprets(text):
    shown = printable(text, None)
    assert_no_control(shown)
    assert printable(shown, None) == shown  # idempotent: escaping twice changes nothing
    line = one_line(f"what {text} — fix")
    assert_no_control(line)
    assert "\n" not in line and len(line) <= 1000


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
    write_named(folder / "model.safetensors", tensors, {"num_heads": "2"})
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
]


@pytest.mark.parametrize("case", SPLIT_INSPECT_CASES, ids=[c[0] for c in SPLIT_INSPECT_CASES])
def test_hostile_names_print_escaped(cli, hostile_checkpoint, case):
    before = digest(hostile_checkpoint)
    result = cli(*case[1](hostile_checkpoint))
    assert_printed_clean(result)
    if "--json" not in case[0]:
        assert "[bold]" in result.stdout or "heatmap" in case[0]  # markup shown, not applied
        assert "\\x1b" in result.stdout
    else:
        json.loads(result.stdout)
    assert digest(hostile_checkpoint) == before


def test_hostile_layer_name_in_an_error(cli, hostile_checkpoint):
    assert_error(cli("inspect", hostile_checkpoint, "--layer", "\x1b]0;x\x07[/]"), 2,
                 "no attention layer named", "\\x1b]0;x\\x07[/]")


@pytest.mark.parametrize("value", ["\x1b[2J", "\u202e7", "[/]"])
def test_hostile_option_values_in_click_errors(cli, value):
    assert_error(cli("split", "-H", value), 2, "--num-heads")


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


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
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
    runs = [
        cli("heatmap", "--random", words, "--out", folder / f"{file_name}.png"),
        cli("heatmap", "--random", words, "--json", "--query", "0"),
        cli("heatmap", "--random", words, "--query", sentence or "x"),
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
