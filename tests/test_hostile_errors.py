"""The error contract: --debug, strict JSON, command-line mistakes (exit 2), terminal widths,
broken config and index JSON, symlink loops, full disks and streams; one `error:` line each.

The contract every case asserts is in tests/hostile.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile import (
    DEEP,
    Result,
    assert_error,
    assert_no_control,
    assert_printed_clean,
    digest,
    mha_state,
    one_thread,  # noqa: F401 - autouse: torch on one thread
    run_process,
    st_bytes,
)

# ------------------------------------------------------------------------------------------
# 6. The error contract


DEBUG_CASES = [
    ("after --", ["heatmap", "--random", "--budget", "sentences=1", "a", "--", "--debug"]),
    ("inside a sentence", ["heatmap", "--random", "--budget", "sentences=1", "a", "x --debug"]),
    ("after the sentences", ["heatmap", "--random", "--budget", "sentences=1", "a", "b",
                             "--", "--debug", "--debug"]),
]


@pytest.mark.parametrize("case", DEBUG_CASES, ids=[c[0] for c in DEBUG_CASES])
def test_debug_is_a_global_option_only(cli, case):
    assert_error(cli(*case[1]), 2, "--budget sentences 1")


def test_debug_before_the_command_shows_the_exception(cli):
    result = cli("--debug", "heatmap", "--random", "--budget", "sentences=1", "a", "b")
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

    from attnviz.compute.measures import stats

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
    ("seed past 2**64", ["split", "--seed", "18446744073709551616"], "--spec seed"),
    ("negative seed", ["heatmap", "--random", "a", "--spec", "seed=-1"], "--spec seed"),
    ("head dim -1", ["split", "--weights", "{mha}", "--head-dim", "-1"],
     "--spec d= must be a positive integer"),
    ("-H 0 on a checkpoint", ["inspect", "{mha}", "-H", "0"],
     "--num-heads must be a positive integer"),
    ("kv heads 0", ["heatmap", "--weights", "{mha}", "-H", "2", "--spec", "kv=0", "a"],
     "--spec kv= must be a positive integer"),
    ("max tokens 0", ["heatmap", "--random", "a", "--budget", "tokens=0"], "--budget tokens"),
    ("max panels -3", ["heatmap", "--random", "a", "--budget", "panels=-3"], "--budget panels"),
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
