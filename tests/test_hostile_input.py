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
from conftest import assert_clean_error, lazy_import
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnviz.core import memory
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


# ------------------------------------------------------------------------------------------
# 6. The error contract


ROOT = Path(__file__).resolve().parents[1]


def run_process(args: list[str], env: dict[str, str] | None = None, stdout=None,
                timeout: int = 120):
    """The real command in a fresh interpreter (real stdout, real environment)."""
    import os
    import subprocess
    import sys

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "attnviz", *map(str, args)], env=full_env,
                          stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, cwd=ROOT)


def in_subprocess(script: str, limits: dict[str, int] | None = None, timeout: int = 120) -> dict:
    """Run `script` (which sets `out`, a JSON-able dict) in a fresh interpreter under resource
    limits (RLIMIT_AS: address space; RLIMIT_FSIZE: largest file), after torch is imported."""
    import subprocess
    import sys

    prelude = (
        "import json, resource, signal, sys\n"
        "import torch, safetensors.torch, matplotlib, numpy\n"
        "from typer.testing import CliRunner\n"
        "from attnviz.cli.main import app\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"for name, value in {limits or {}!r}.items():\n"
        "    resource.setrlimit(getattr(resource, name), (value, value))\n"
        "def cli(*args):\n"
        "    r = CliRunner().invoke(app, [str(a) for a in args])\n"
        "    return {'code': r.exit_code, 'stdout': r.stdout, 'stderr': r.stderr,\n"
        "            'exception': repr(r.exception) if r.exit_code not in (0, 1, 2) else ''}\n"
        "out = {}\n")
    done = "\nprint('RESULT' + json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", prelude + script + done], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("RESULT", 1)[1])


class Result:
    """A subprocess result shaped like click's, for assert_clean_error."""

    def __init__(self, doc: dict) -> None:
        self.exit_code = doc["code"]
        self.stdout, self.stderr = doc["stdout"], doc["stderr"]
        self.output = self.stdout + self.stderr


DEBUG_CASES = [
    ("after --", ["heatmap", "--random", "--max-sentences", "1", "a", "--", "--debug"]),
    ("inside a sentence", ["heatmap", "--random", "--max-sentences", "1", "a", "x --debug"]),
    ("after the sentences", ["heatmap", "--random", "--max-sentences", "1", "a", "b",
                             "--", "--debug", "--debug"]),
]


@pytest.mark.parametrize("case", DEBUG_CASES, ids=[c[0] for c in DEBUG_CASES])
def test_debug_is_a_global_option_only(cli, case):
    assert_error(cli(*case[1]), 2, "--max-sentences 1")


def test_debug_before_the_command_shows_the_exception(cli):
    result = cli("--debug", "heatmap", "--random", "--max-sentences", "1", "a", "b")
    assert type(result.exception).__name__ == "UsageError"
    assert_error(cli("heatmap", "--debug", "--random", "a"), 2, "No such option: --debug")


def test_strict_json_replaces_non_finite_values():
    from attnviz.render.json_out import strict_json

    text = strict_json({"a": [1.0, float("nan"), {"b": float("inf")}], "c": -float("inf"),
                        "d": "\x1b[2J\u202e"})

    def refuse(word):
        raise AssertionError(f"bare {word} in JSON")

    doc = json.loads(text, parse_constant=refuse)
    assert doc["a"] == [1.0, None, {"b": None}] and doc["c"] is None
    assert doc["non_finite_values"] == {"a[1]": "NaN", "a[2].b": "Infinity", "c": "-Infinity"}
    assert text.isascii() and "\\u001b" in text


def test_json_output_is_strict_when_a_statistic_is_not_finite(cli, monkeypatch):
    import dataclasses

    from attnviz.compute import stats

    real = stats.head_stats

    def broken(*args, **kwargs):
        return [dataclasses.replace(s, entropy=float("nan")) for s in real(*args, **kwargs)]

    monkeypatch.setattr(stats, "head_stats", broken)
    result = cli("heatmap", "--random", "a b c", "--json")
    assert_printed_clean(result)
    doc = json.loads(result.stdout, parse_constant=lambda word: pytest.fail(word))
    assert doc["head_stats"][0]["entropy"] is None
    assert doc["non_finite_values"]["head_stats[0].entropy"] == "NaN"


@pytest.fixture(scope="module")
def mha_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mha") / "mha.safetensors"
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save(mha_state(), path)
    return path


USAGE_CASES = [
    ("seed past 2**64", ["split", "--seed", "18446744073709551616"], "--seed"),
    ("negative seed", ["heatmap", "--random", "a", "--seed", "-1"], "--seed"),
    ("head dim -1", ["split", "--weights", "{mha}", "--head-dim", "-1"],
     "--head-dim must be a positive integer"),
    ("-H 0 on a checkpoint", ["inspect", "{mha}", "-H", "0"],
     "--num-heads must be a positive integer"),
    ("kv heads 0", ["heatmap", "--weights", "{mha}", "-H", "2", "--num-kv-heads", "0", "a"],
     "--num-kv-heads must be a positive integer"),
    ("max tokens 0", ["heatmap", "--random", "a", "--max-tokens", "0"], "--max-tokens"),
    ("max panels -3", ["heatmap", "--random", "a", "--max-panels", "-3"], "--max-panels"),
    ("5000-digit -H", ["split", "-H", "1" * 5000], "--num-heads"),
    ("over-long --model id", ["heatmap", "--model", "org/" + "m" * 5000, "a"],
     "the path given to --model is too long"),
    ("over-long name", ["inspect", "x" * 300 + ".safetensors"], "CHECKPOINT is too long"),
    ("over-long output", ["split", "--png", "y" * 300 + ".png"], "--png is too long"),
    ("over-long --file", ["heatmap", "-f", "d/" * 2100 + "s.txt"], "--file is too long"),
]


@pytest.mark.parametrize("case", USAGE_CASES, ids=[c[0] for c in USAGE_CASES])
def test_command_line_mistakes_exit_2(cli, mha_file, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    before = digest(mha_file.parent)
    args = [str(mha_file) if a == "{mha}" else a for a in case[1]]
    assert_error(cli(*args), 2, case[2])
    assert list(tmp_path.iterdir()) == [] and digest(mha_file.parent) == before


@pytest.mark.parametrize("columns", ["0", "3", "99999999", "1" * 5000, "²"])
def test_unusable_terminal_width_falls_back(cli, monkeypatch, columns):
    """An unusable COLUMNS is replaced by 80 with a note, not refused (issue 24)."""
    monkeypatch.setenv("COLUMNS", columns)
    result = cli("split")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("note: COLUMNS=") and "using 80 columns" in result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def _config_folder(root: Path, config_text: str) -> Path:
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save(mha_state(prefix="layers.0.self_attn."), folder / "model.safetensors")
    return folder


DEEP = "[" * 100_000 + "]" * 100_000
BAD_JSON_CASES = [
    ("deep nesting", '{"a": ' + DEEP + "}", "nests arrays or objects deeper"),
    ("5000-digit integer", '{"num_attention_heads": ' + "7" * 5000 + "}", "more digits"),
    ("NaN", '{"model_type": "llama", "rope_theta": NaN}', "field 'rope_theta' is NaN"),
    ("Infinity", '{"rope_scaling": {"factor": -Infinity}}',
     "field 'rope_scaling.factor' is -Infinity"),
    ("1e999", '{"layer_norm_eps": [1e999]}', "field 'layer_norm_eps[0]' is Infinity"),
    ("not UTF-8", b'{"a": "\xff"}', "not UTF-8"),
]


@pytest.mark.parametrize("case", BAD_JSON_CASES, ids=[c[0] for c in BAD_JSON_CASES])
def test_hostile_config_json_is_a_specific_error(cli, tmp_path, case):
    folder = _config_folder(tmp_path, "{}")
    path = folder / "config.json"
    path.write_bytes(case[1] if isinstance(case[1], bytes) else case[1].encode())
    before = digest(tmp_path)
    for args in (["inspect", folder], ["heatmap", "--weights", folder, "-H", "2", "a"]):
        assert_error(cli(*args), 1, "config.json", case[2])
    assert digest(tmp_path) == before


def test_hostile_header_and_index_json(cli, tmp_path):
    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(st_bytes(DEEP.encode()))
    assert_error(cli("inspect", deep), 1, "safetensors", "nests arrays or objects deeper")
    digits = tmp_path / "digits.safetensors"
    digits.write_bytes(st_bytes(b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}"))
    assert_error(cli("inspect", digits), 1, "safetensors", "more digits")
    folder = _config_folder(tmp_path, "{}")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    assert_error(cli("inspect", folder), 1, "model.safetensors.index.json", "deeper")


def test_symlink_loops_are_named(cli, tmp_path):
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    assert_error(cli("inspect", loop), 1, "symbolic link loop")
    assert_error(cli("heatmap", "--weights", loop, "a"), 1, "symbolic link loop")
    png = tmp_path / "loop.png"
    png.symlink_to(png)
    assert_error(cli("split", "--png", png), 1, "symlink loop")
    folder = _config_folder(tmp_path, "{}")
    (folder / "shard.safetensors").symlink_to(folder / "shard.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x.in_proj_weight": "shard.safetensors"}}))
    assert_error(cli("inspect", folder), 1, "shard 'shard.safetensors' is a symbolic link loop")


def test_full_disk_before_writing(cli, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 0))
    assert_error(cli("heatmap", "--random", "a b", "--export", tmp_path / "m.safetensors"), 1,
                 "MB free", "free some space")
    assert list(tmp_path.iterdir()) == []


def test_full_disk_while_writing(cli, tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)  # where the PNG's bytes are written
    assert_error(cli("split", "--png", tmp_path / "s.png"), 1,
                 "cannot write the output: No space left on device", "free some space")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_file_size_limit_while_writing(capped):
    """A real failing write (RLIMIT_FSIZE, in the capped run): no partial file, one error line,
    for a figure and for an export (whose writer is Rust, not Python)."""
    results = capped[1]
    assert_error(Result(results["fsize-png"]), 1, "cannot write the output", "File too large")
    assert_error(Result(results["fsize-export"]), 1, "cannot write the output")
    assert list((capped[0] / "writes").iterdir()) == []


@pytest.mark.slow
def test_full_stdout_and_ascii_stdout():
    full = run_process(["split", "--json"], stdout=open("/dev/full", "w"))  # noqa: SIM115
    assert full.returncode == 1
    assert full.stderr.decode().strip().splitlines() == [
        "error: cannot write to stdout: No space left on device — free some space on that "
        "device, or write somewhere else"]
    ascii_out = run_process(["split"], env={"PYTHONIOENCODING": "ascii"})
    assert ascii_out.returncode == 2
    lines = ascii_out.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "stdout's encoding ascii cannot show" in lines[0]
    assert "PYTHONIOENCODING=utf-8" in lines[0] and "Traceback" not in lines[0]


def test_ascii_stdout_in_process():
    """The same check with an ASCII stdout in process; --json output is ASCII and works."""
    from typer.testing import CliRunner

    from attnviz.cli.main import app

    runner = CliRunner(charset="ascii")
    result = runner.invoke(app, ["split", "-E", "8", "-H", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()  # stdout may hold the lines printed before
    assert len(lines) == 1 and "stdout's encoding ascii cannot show" in lines[0]
    assert "or pass --json" in lines[0]
    assert_no_control(result.stdout, result.stderr)
    as_json = runner.invoke(app, ["split", "--json", "-E", "8", "-H", "2"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["num_heads"] == 2


# ------------------------------------------------------------------------------------------
# 3. No header, metadata or config value sizes the work

MEMORY_CAP = 1_600_000_000  # address space for torch + attnviz (~0.8 GB) and a little work


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: on a shared machine torch's second thread spins more than it computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bundled_with(path: Path, **metadata: str) -> Path:
    """The bundled model, rewritten with some metadata values changed."""
    from conftest import BUNDLED
    from safetensors import safe_open

    with safe_open(str(BUNDLED), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        meta = {**f.metadata(), **metadata}
    write_named(path, tensors, meta)
    return path


@pytest.fixture(scope="module")
def capped(tmp_path_factory) -> tuple[Path, dict[str, dict], dict[str, str]]:
    """Hostile inputs that claim gigabytes, each run by the CLI in one fresh interpreter whose
    address space is capped at 1.6 GB, torch included: (folder, results, digest before)."""
    folder = tmp_path_factory.mktemp("capped")
    zero = folder / "zero.safetensors"  # a zero-sized axis: 3·10⁹ rows of nothing
    zero.write_bytes(st_bytes({
        "__metadata__": {"num_heads": "1000000000"},
        "in_proj_weight": {"dtype": "F32", "shape": [3_000_000_000, 0], "data_offsets": [0, 0]},
        "out_proj.weight": {"dtype": "F32", "shape": [0, 1_000_000_000],
                            "data_offsets": [0, 0]}}))
    assert zero.stat().st_size < 300
    layers = bundled_with(folder / "layers.safetensors", num_layers="100000000")
    vocab = bundled_with(folder / "vocab.safetensors", vocab_size="4000000000")
    stride = folder / "stride0.pt"  # 1.7 KB viewing 4 bytes as 40 GB
    torch.save({"in_proj_weight": torch.zeros(1).expand(100_000, 100_000),
                "out_proj.weight": torch.zeros(1).expand(100_000, 100_000)}, stride)
    assert stride.stat().st_size < 2000
    overlap = folder / "overlap.pt"
    base = torch.zeros(300_000)
    torch.save({"in_proj_weight": base.as_strided((200_000, 100_000), (1, 1)),
                "out_proj.weight": base[:4].view(2, 2)}, overlap)
    model_configs = {"n_layer": 100_000, "n_positions": 100_000_000, "vocab_size": 100_000_000,
                     "n_embd": 100_000}
    gpt2 = folder / "gpt2"
    from tiny_models import build_tiny

    build_tiny("gpt2", gpt2)
    for field, value in model_configs.items():
        import shutil

        shutil.copytree(gpt2, folder / field)
        config = json.loads((folder / field / "config.json").read_text())
        (folder / field / "config.json").write_text(json.dumps({**config, field: value}))
    before = digest(folder)
    cases = {
        **{f"config-{field}": ["heatmap", "--model", folder / field, "the cat"]
           for field in model_configs},
        "zero-inspect": ["inspect", zero], "zero-split": ["split", "--weights", zero],
        "zero-heatmap": ["heatmap", "--weights", zero, "a b"],
        "layers": ["heatmap", "--weights", layers, "a b"],
        "vocab": ["heatmap", "--weights", vocab, "a b"],
        "stride-inspect": ["inspect", stride],
        "stride-split": ["split", "--weights", stride, "-H", "2"],
        "overlap": ["inspect", overlap, "--scan", "-H", "2"],
        "dev-zero": ["heatmap", "--random", "-f", "/dev/zero"],
        "dev-zero-long-lines": ["heatmap", "--random", "-f", "/dev/zero", "--max-tokens",
                                "1000000"],
    }
    script = "".join(f"out[{name!r}] = cli(*{[str(a) for a in args]!r})\n"
                     for name, args in cases.items())
    writes = folder / "writes"  # then, files may not grow past 2000 bytes
    writes.mkdir()
    script += (
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))\n"
        f"out['fsize-png'] = cli('heatmap', '--random', 'a b c', '--out', {str(writes)!r} + "
        "'/f.png')\n"
        "out['fsize-export'] = cli('heatmap', '--random', 'a b c d e f g h i j k l', "
        f"'--export', {str(writes)!r} + '/m.safetensors')\n")
    results = in_subprocess(script, limits={"RLIMIT_AS": MEMORY_CAP})
    return folder, results, before


HEADER_SIZE_CASES = {
    "config-n_layer": "config.json field 'n_layer' is 100000, but the weights number at most 2 "
                      "layers",
    "config-n_positions": "config.json describes 'wpe.weight' as (100000000, 32), but the "
                          "weights hold (64, 32)",
    "config-vocab_size": "config.json describes 'wte.weight' as (100000000, 32)",
    "config-n_embd": "config.json describes 'wte.weight' as (19, 100000)",
    "zero-inspect": "zero-sized dimension", "zero-split": "zero-sized dimension",
    "zero-heatmap": "zero-sized dimension",
    "layers": "num_layers is 100000000, but the file holds 2 attention layers",
    "vocab": "vocab_size is 4000000000, but the file holds that many embedding rows",
    "stride-inspect": "views only 4 bytes of data (strides (0, 0)",
    "stride-split": "views only 4 bytes", "overlap": "views only 1200000 bytes",
}


@pytest.mark.slow  # `capped` runs every case in one capped interpreter: seconds
@pytest.mark.parametrize("name", sorted(HEADER_SIZE_CASES))
def test_work_sized_by_headers_stays_under_a_memory_cap(capped, name):
    folder, results, before = capped
    assert_error(Result(results[name]), 1, HEADER_SIZE_CASES[name])
    assert digest(folder) == before


@pytest.mark.parametrize("value", ["1e8", "²", "١٢", "9" * 5000, "-2", "0x10"])
def test_metadata_counts_must_be_plain_integers(cli, tmp_path, value):
    path = bundled_with(tmp_path / "m.safetensors", num_layers=value)
    assert_error(cli("heatmap", "--weights", path, "a b"), 1, "num_layers",
                 "expected a positive integer")


PICKLE_CASES = [
    ("meta", lambda: torch.empty(8, 8, device="meta"), "meta tensor: it has a shape but no data"),
    ("sparse", lambda: torch.eye(8).to_sparse(), "sparse_coo tensor, not a dense one"),
    ("csr", lambda: torch.eye(8).to_sparse_csr(), "sparse_csr tensor, not a dense one"),
]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c[0] for c in PICKLE_CASES])
def test_pickled_tensors_without_dense_data(cli, tmp_path, case):
    import warnings

    path = tmp_path / f"{case[0]}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"in_proj_weight": case[1](), "out_proj.weight": torch.zeros(8, 8)}, path)
    before = digest(tmp_path)
    for args in (["inspect", path], ["split", "--weights", path, "-H", "2"]):
        assert_error(cli(*args), 1, "'in_proj_weight'", case[2])
    assert digest(tmp_path) == before


def test_divisors_are_found_in_square_root_time():
    import time

    from attnviz.core.layer import divisor_choices, divisors

    start = time.perf_counter()
    prime = 999_999_999_989  # the worst case below the bound: 10⁶ trial divisions
    assert divisors(prime) == [1, prime]
    assert time.perf_counter() - start < 5
    assert divisors(10**13) == []  # beyond the search bound: not listed at all
    assert divisors(360)[:6] == [1, 2, 3, 4, 5, 6] and len(divisors(360)) == 24
    assert divisor_choices(360) == ("1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 15, 18, 20, 24, 30, …, 360 "
                                    "(24 divisors)")
    assert divisor_choices(10**13) == f"the divisors of {10**13}"


def test_a_large_prime_row_count_is_fast(cli, tmp_path):
    path = tmp_path / "prime.safetensors"
    rows = 1_000_003  # prime: nothing divides it, and listing divisors must not loop a million
    write_named(path, {"q_proj.weight": torch.zeros(rows, 1),
                       "k_proj.weight": torch.zeros(rows, 1),
                       "v_proj.weight": torch.zeros(rows, 1),
                       "o_proj.weight": torch.zeros(1, rows)})
    assert_error(cli("inspect", path, "-H", "7"), 2, "not divisible by 7 heads",
                 f"choose the number of heads from 1, {rows}")


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.integers(0, 6), min_size=1, max_size=8),
       picks=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=5))
def test_composed_row_ranges_equal_the_naive_mapping(blocks, picks):
    from attnviz.core.tensor_ref import _compose_ranges, merge_ranges

    base, start = [], 0
    for size in blocks:
        base.append((start * 3, start * 3 + size))  # gaps between blocks
        start += size + 1
    rows = [r for a, b in base for r in range(a, b)]  # row i of the concatenation → absolute
    ranges = tuple((a, a + n) for a, n in picks)
    expected = merge_ranges(tuple((r, r + 1) for a, b in ranges for r in rows[a:b]))
    assert _compose_ranges(tuple(base), ranges) == expected


def many_heads_file(folder: Path, heads: int) -> Path:
    """A LLaMA-style layer with `heads` heads of d = 1 over E = 4: a 2.5 MB file at 40,000."""
    folder.mkdir()
    torch.manual_seed(0)
    prefix = "model.layers.0.self_attn."
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save({prefix + "q_proj.weight": torch.randn(heads, 4),
          prefix + "k_proj.weight": torch.randn(heads, 4),
          prefix + "v_proj.weight": torch.randn(heads, 4),
          prefix + "o_proj.weight": torch.randn(4, heads)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "head_dim": 1,
                                                    "num_attention_heads": heads}))
    return folder


@pytest.mark.slow
def test_forty_thousand_heads_cost_linear_time(cli, tmp_path):
    """No O(H²) step: slicing 40,000 heads and their per-head norms take seconds."""
    import time

    from attnviz.compute.split import split_projections
    from attnviz.recognize import find_layers
    from attnviz.sources.layers import open_inventory

    folder = many_heads_file(tmp_path / "many", 40_000)
    inventory, _ = open_inventory(folder, __import__(
        "attnviz.recognize.base", fromlist=["HeadHints"]).HeadHints())
    layer = inventory.layers[0]
    start = time.perf_counter()
    projections = split_projections(layer)
    assert len(projections["k"].heads) == 40_000
    assert time.perf_counter() - start < 10
    start = time.perf_counter()
    result = cli("inspect", folder, "--layer", "0")
    assert time.perf_counter() - start < 30
    assert_printed_clean(result)
    assert "… 39936 more heads not shown (--json lists all)" in result.stdout
    assert len(result.stdout.splitlines()) < 120  # O(shown), not O(heads)
    assert find_layers  # imported for the inventory above


@pytest.mark.slow
def test_many_heads_print_a_bounded_terminal(cli, tmp_path):
    folder = many_heads_file(tmp_path / "many", 4000)
    for args in (["split", "--weights", folder], ["heatmap", "--weights", folder, "a b c"]):
        result = cli(*args)
        assert_printed_clean(result)
        assert len(result.stdout.splitlines()) < 700, args
        assert "more heads not shown" in result.stdout or "more rows not shown" in result.stdout
    heatmap = cli("heatmap", "--weights", folder, "a b c", "--json")
    assert len(json.loads(heatmap.stdout)["head_stats"]) == 4000  # --json keeps every head


def test_per_stage_head_counts_do_not_break_inspect(cli, tmp_path):
    """Swin's config gives one head count per stage: T5's finder must not claim `num_heads`,
    and each stage's layers take their own count."""
    folder = tmp_path / "swin"
    folder.mkdir()
    tensors = {}
    for stage, width in ((0, 8), (1, 16)):
        block = f"swin.encoder.layers.{stage}.blocks.0.attention."
        for name in ("query", "key", "value"):
            tensors[f"{block}self.{name}.weight"] = torch.zeros(width, width)
        tensors[f"{block}output.dense.weight"] = torch.zeros(width, width)
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save(tensors, folder / "model.safetensors")
    # a config that describes these weights: stage widths embed_dim · 2^stage = 8, 16
    (folder / "config.json").write_text(json.dumps({"model_type": "swin", "embed_dim": 8,
                                                    "num_heads": [2, 4], "depths": [1, 1]}))
    result = cli("inspect", folder, "--json")
    assert_printed_clean(result)
    assert [layer["num_heads"] for layer in json.loads(result.stdout)["layers"]] == [2, 4]


def test_streamed_runs_keep_display_maps_of_the_first_heads_only(cli, monkeypatch):
    from attnviz.compute import maps, streaming

    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)  # stream every run
    monkeypatch.setattr(streaming, "MAX_VIEW_HEADS", 2)
    monkeypatch.setattr(maps, "MAX_VIEW_HEADS", 2)
    kept = []
    finish = streaming.MapReducer.finish

    def spy(self, *args, **kwargs):
        result = finish(self, *args, **kwargs)
        kept.append(sorted({v.head for v in result.views if v.head is not None}))
        return result

    monkeypatch.setattr(streaming.MapReducer, "finish", spy)
    result = cli("heatmap", "--random", "-E", "16", "-H", "8", "a b c a b", "--json")
    assert_printed_clean(result)
    assert kept == [[0, 1]] and len(json.loads(result.stdout)["head_stats"]) == 8
    assert_error(cli("heatmap", "--random", "-E", "16", "-H", "8", "a b c", "--head", "5"), 2,
                 "only the maps of heads 0..1 are kept", "--export")


# ------------------------------------------------------------------------------------------
# 4. Inputs read within bounds


@pytest.mark.parametrize("name", ["dev-zero", "dev-zero-long-lines"])
def test_endless_sentence_file_stops_at_the_limit_under_a_memory_cap(capped, name):
    """/dev/zero is one endless line: refused after max(64 KiB, 64 bytes per --max-tokens)."""
    limit = 65536 if name == "dev-zero" else 64_000_000
    assert_error(Result(capped[1][name]), 2, f"line 1 of the sentence file is longer than "
                 f"{limit} bytes", "/dev/zero")


class FifoWriter:
    """Writes `line` into a FIFO for as long as it is read (the writer end never closes)."""

    def __init__(self, path: Path, line: bytes) -> None:
        import os
        import threading

        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # never blocks, even unread
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(line * 64,), daemon=True)
        self.thread.start()

    def _run(self, chunk: bytes) -> None:
        import os
        import time

        while not self.stop.is_set():
            try:
                os.write(self.fd, chunk)
            except BlockingIOError:
                time.sleep(0.001)

    def close(self) -> None:
        import os

        self.stop.set()
        self.thread.join()
        os.close(self.fd)


FILE_CASES = [
    ("too many lines", b"the cat sat\n" * 100, ["--max-sentences", "3"],
     "the sentence file holds more than 3 sentences"),
    ("too many with arguments", b"a b\n" * 10, ["--max-sentences", "4", "x", "y"],
     "holds more than 2 sentences besides the 2 given"),
    ("a line over --max-tokens", b"a b\n" + b"w " * 50 + b"\n" + b"\xff" * 10,
     ["--max-tokens", "20"], "sentence 2 (line 2) has 50 tokens, more than --max-tokens 20"),
    ("invalid UTF-8", b"fine\n\nok \xc3\x28 no\n", [],
     "line 3 of the sentence file is not UTF-8 text (byte 4 of the line)"),
    ("a NUL flood", b"\x00" * 70_000, [], "line 1 of the sentence file is longer than 65536"),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_sentence_file_is_refused_as_soon_as_it_passes_a_limit(cli, tmp_path, case):
    path = tmp_path / "s.txt"
    path.write_bytes(case[1])
    code = 1 if case[0] == "invalid UTF-8" else 2  # the file's content is data (issue 24)
    assert_error(cli("heatmap", "--random", "-f", path, *case[2]), code, case[3])
    assert path.read_bytes() == case[1] and list(tmp_path.iterdir()) == [path]


def test_sentence_file_that_is_not_a_file(cli, tmp_path):
    import os
    import time

    assert_error(cli("heatmap", "--random", "-f", tmp_path), 2, "the sentence file is a folder")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.perf_counter()  # no writer: read as empty at once, never waiting for one
    assert_error(cli("heatmap", "--random", "-f", fifo), 2, "no sentence given")
    writer = FifoWriter(fifo, b"the cat sat on the mat\n")  # an endless writer
    try:
        assert_error(cli("heatmap", "--random", "-f", fifo), 2,
                     "the sentence file holds more than 64 sentences")
    finally:
        writer.close()
    assert time.perf_counter() - start < 20
    writer = FifoWriter(fifo, b"w " * 40_000)  # an endless line
    try:
        assert_error(cli("heatmap", "--random", "-f", fifo), 2, "longer than 65536 bytes")
    finally:
        writer.close()


def vocab_folder(root: Path, vocab_words: list[str] | None = None) -> Path:
    folder = root / "model"
    folder.mkdir()
    torch.manual_seed(0)
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save({**mha_state(), "embeddings.word_embeddings.weight": torch.randn(1000, 8)},
         folder / "model.safetensors")
    if vocab_words is not None:
        (folder / "vocab.txt").write_text("\n".join(vocab_words) + "\n")
    return folder


def test_embedding_rows_are_read_for_the_tokens_used(cli, tmp_path, monkeypatch):
    from attnviz.load import checkpoint

    folder = vocab_folder(tmp_path, ["[UNK]", "the", "cat", "sat"])
    reads, rows = [], []
    real_read, real_rows = checkpoint.TensorStore.read, checkpoint.TensorStore.read_rows
    monkeypatch.setattr(checkpoint.TensorStore, "read",
                        lambda self, name: reads.append(name) or real_read(self, name))
    monkeypatch.setattr(checkpoint.TensorStore, "read_rows", lambda self, name, a, b: (
        rows.append((name, a, b)) or real_rows(self, name, a, b)))
    result = cli("heatmap", "--weights", folder, "-H", "2", "the cat sat the dog", "--json")
    assert_printed_clean(result)
    assert "5 of 5 tokens found" in json.loads(result.stdout)["inputs"]  # dog → [UNK]
    table = "embeddings.word_embeddings.weight"
    assert table not in reads  # never the whole table
    assert sorted(r for r in rows if r[0] == table) == [(table, 0, 1), (table, 1, 2),
                                                         (table, 2, 3), (table, 3, 4)]


def test_vocabulary_files_have_size_caps(cli, tmp_path):
    import os

    from attnviz.compute import inputs

    folder = vocab_folder(tmp_path)
    vocab = folder / "vocab.txt"
    with open(vocab, "wb") as f:  # sparse: large on paper, nothing on disk
        f.truncate(inputs.MAX_VOCAB_TXT_BYTES + 1)
    before = digest(tmp_path)
    assert_error(cli("heatmap", "--weights", folder, "-H", "2", "a b"), 1, "vocab.txt holds",
                 f"more than the {inputs.MAX_VOCAB_TXT_BYTES}-byte limit")
    vocab.unlink()
    os.mkfifo(vocab)  # would block a plain open() forever
    assert_error(cli("heatmap", "--weights", folder, "-H", "2", "a b"), 1,
                 "vocab.txt is not a regular file")
    vocab.unlink()
    tokenizer = folder / "tokenizer.json"
    with open(tokenizer, "wb") as f:
        f.truncate(inputs.MAX_TOKENIZER_JSON_BYTES + 1)
    assert_error(cli("heatmap", "--weights", folder, "-H", "2", "a b"), 1,
                 "tokenizer.json holds")
    tokenizer.write_text('{"model": {"vocab": ' + DEEP + "}}")
    assert_error(cli("heatmap", "--weights", folder, "-H", "2", "a b"), 1,
                 "tokenizer.json nests arrays or objects deeper")
    assert digest(tmp_path).keys() <= before.keys() | {"model/tokenizer.json"}


# ------------------------------------------------------------------------------------------
# 5. Third-party failures contained (transformers, tokenizers)

transformers = lazy_import("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models transformers writes itself, with small WordLevel tokenizers (test_hf)."""
    import base64
    import shutil
    import warnings

    from tiny_models import VOCAB, build_tiny, save_tokenizer

    root = tmp_path_factory.mktemp("models")
    folders = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2 = folders["gpt2"] = root / "gpt2"
        build_tiny("gpt2", gpt2)
        for name in ("no-tokenizer", "panics", "missing-weight", "foreign-tokenizer"):
            shutil.copytree(gpt2, root / name)
            folders[name] = root / name
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / "no-tokenizer" / name).unlink()
        tok = root / "panics" / "tokenizer.json"  # a charsmap the Rust parser panics on
        doc = json.loads(tok.read_text())
        doc["normalizer"] = {"type": "Precompiled", "precompiled_charsmap":
                             base64.b64encode(b"\xff\xff\xff\x7f" + b"\x01" * 64).decode()}
        tok.write_text(json.dumps(doc))
        from safetensors.torch import load_file, save_file

        weights = root / "missing-weight" / "model.safetensors"
        tensors = load_file(weights)
        del tensors["h.1.mlp.c_fc.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
        tok = root / "foreign-tokenizer" / "tokenizer.json"  # no word of ours, ids past 19 rows
        doc = json.loads(tok.read_text())
        doc["model"]["vocab"] = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, "zebra": 40}
        tok.write_text(json.dumps(doc))
        vit = folders["vit"] = root / "vit"
        transformers.ViTModel(transformers.ViTConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            image_size=8, patch_size=4)).save_pretrained(vit)
        save_tokenizer(vit, True, "right", False)
        whisper = folders["whisper"] = root / "whisper"
        transformers.WhisperModel(transformers.WhisperConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=VOCAB,
            pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
            num_mel_bins=4, max_source_positions=8, max_target_positions=8)).save_pretrained(
            whisper)
        save_tokenizer(whisper, True, "right", False)
        clip = folders["clip"] = root / "clip"
        torch.manual_seed(0)
        transformers.CLIPModel(transformers.CLIPConfig(
            text_config={"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "intermediate_size": 16, "vocab_size": VOCAB,
                         "max_position_embeddings": 16},
            vision_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "intermediate_size": 16, "image_size": 8, "patch_size": 4},
            projection_dim=8)).save_pretrained(clip)
        save_tokenizer(clip, True, "right", False)
    return folders


MODEL_ERRORS = [
    ("no tokenizer files", "no-tokenizer", 1, "the model folder has no tokenizer files"),
    ("token ids past the embedding", "foreign-tokenizer", 1,
     "the model's tokenizer gives token id 40, but the model's embedding has 19 rows"),
    ("a tokenizer that panics", "panics", 1,
     "the model's tokenizer cannot be loaded (PanicException: Precompiled"),
    ("a weight left out", "missing-weight", 1, "the weights lack 'h.1.mlp.c_fc.weight', which "
     "the model runs (transformers would fill them with random numbers)"),
    ("a tokenizer of another model", "foreign-tokenizer", 1,
     "the model's tokenizer maps every word of the sentences to its unknown token"),
    ("a vision model", "vit", 2, "model_type 'vit' takes images (pixel_values), not text"),
    ("an audio model", "whisper", 2, "model_type 'whisper' takes audio (input_features), not "
     "text"),
]


@pytest.mark.parametrize("case", MODEL_ERRORS, ids=[c[0] for c in MODEL_ERRORS])
def test_model_failures_in_attnviz_words(cli, models, case):
    """One line of attnviz's own on stderr: no transformers warning, load report, Rust panic
    message or traceback."""
    folder = models[case[1]]
    before = digest(folder)
    sentence = "zebra" if "past the embedding" in case[0] else "the cat sat"
    assert_error(cli("heatmap", "--model", folder, sentence), case[2], case[3])
    assert digest(folder) == before


def test_a_tokenizer_panic_while_encoding_is_contained(cli, models, monkeypatch):
    from tokenizers import Tokenizer

    with pytest.raises(BaseException) as caught:  # a real pyo3_runtime.PanicException
        Tokenizer.from_str((models["panics"] / "tokenizer.json").read_text())
    panic = type(caught.value)
    assert not issubclass(panic, Exception) and panic.__name__ == "PanicException"

    def explode(self, *args, **kwargs):
        raise panic("index out of bounds")

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", explode)
    assert_error(cli("heatmap", "--model", models["gpt2"], "the cat sat"), 1,
                 "the model's tokenizer failed on sentence 1 (PanicException: index out of")


def test_a_clean_model_run_writes_nothing_on_stderr(cli, models):
    """This config's bos/eos ids lie outside its 19-word vocabulary, which transformers warns
    about on every load: attnviz keeps it off the terminal."""
    result = cli("heatmap", "--model", models["gpt2"], "the cat sat", "--no-maps")
    assert_printed_clean(result)
    assert result.stderr == ""


def test_a_multi_tower_model_runs_its_text_tower(cli, models):
    result = cli("heatmap", "--model", models["clip"], "the cat sat", "--json")
    assert_printed_clean(result)
    doc = json.loads(result.stdout)
    assert [layer["name"] for layer in doc["layers"]] == [
        f"text_model.encoder.layers.{i}.self_attn" for i in range(2)]
    assert doc["causal"] is True and result.stderr == ""


def test_hostile_tokenizer_tokens_print_escaped(cli, tmp_path):
    """Tokens come from the model's tokenizer: escape sequences and markup in its vocabulary
    are shown escaped in maps, --query tables and errors, and as \\u escapes in --json."""
    from tiny_models import build_tiny
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "gpt2"
    build_tiny("gpt2", folder)
    words = ["\x1b[2J", "[bold]", "\u202eevil", "\x9b31m", "$\\frac{", ":smile:"]
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # whole words, escapes included
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(folder)
    sentence = " ".join(words)
    for args in (["--query", "[bold]"], ["--json"], ["--query", "\x1b]0;x\x07"]):
        result = cli("heatmap", "--model", folder, sentence, *args)
        assert result.exit_code in (0, 2) and "Traceback" not in result.output
        assert_no_control(result.stdout, result.stderr)
    assert "[bold]" in cli("heatmap", "--model", folder, sentence).stdout


CONFIG_TYPES = [
    ("scale_attn_weights", "yes", "config.json field 'scale_attn_weights' is 'yes', expected "
     "true or false"),
    # a list where a count belongs: attnviz notes it (Swin keeps one per stage); transformers'
    # own validation of GPT-2's config refuses it, reported as a config.json error
    ("n_head", [2, 2], "cannot read the model's config.json"),
    ("n_positions", 1.5, "cannot read the model's config.json"),
    ("n_inner", -5, "cannot read the model's config.json"),
]


@pytest.mark.parametrize("case", CONFIG_TYPES, ids=[c[0] for c in CONFIG_TYPES])
def test_config_fields_of_unexpected_types(cli, models, tmp_path, case):
    import shutil

    folder = tmp_path / "gpt2"
    shutil.copytree(models["gpt2"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, case[0]: case[1]}))
    assert_error(cli("heatmap", "--model", folder, "the cat"), 1, case[2])
