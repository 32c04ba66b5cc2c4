"""Paths that are not UTF-8 reach every library that opens them as names it accepts (issue #36
item 7, round three): a folder named with byte 0xff or 0xe9, passed as bytes on argv, works as
--model, --weights (file and folder), and under inspect, split, circuits, --out, --html and
--export; it is never blamed on the model's tokenizer.

Python decodes such argv bytes with surrogate escapes ('\\udcff'); the in-process runs pass that
str, which is what `sys.argv` holds; one run per library family goes through a real interpreter
with the bytes on argv. Negative control: with the ASCII link turned off, the tokenizer library
fails on the same folder, which is the failure the earlier rounds blamed on the tokenizer files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SAMPLES, assert_clean_error, finish, needs_safe_pickles
from safetensors.torch import save_file

from attnviz.errors import UsageError
from attnviz.load import paths

ROOT = Path(__file__).resolve().parents[1]
DISTILBERT = SAMPLES / "models" / "distilbert-tiny-model"


def _bad_folder(tmp_path: Path, byte: bytes = b"\xff") -> Path:
    """tmp_path/caf<byte>/: a folder whose name is not UTF-8, as Python names it."""
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf" + byte))
    folder.mkdir()
    with pytest.raises(UnicodeEncodeError):
        str(folder).encode("utf-8")
    return folder


def _run(args: list[str | Path]) -> subprocess.CompletedProcess:
    """`python -m attnviz ARGS` with every argument as bytes on argv."""
    argv = [os.fsencode(sys.executable), b"-m", b"attnviz", *(os.fsencode(str(a)) for a in args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return finish(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE), timeout=300)


def _mha_file(path: Path) -> None:
    torch.manual_seed(0)
    state = torch.nn.MultiheadAttention(8, 2).state_dict()
    # written through the ASCII link: safetensors' writer cannot take the name either
    save_file({k: v.contiguous() for k, v in state.items()},
              str(paths.library_path(path.parent) / path.name), metadata={"num_heads": "2"})


def test_weights_file_and_folder_under_every_command(cli, tmp_path):
    folder = _bad_folder(tmp_path)
    weights = folder / "w.safetensors"
    _mha_file(weights)
    model = folder / "m"
    shutil.copytree(DISTILBERT, model)
    before = sorted(p.name for p in folder.iterdir())
    runs = {
        "inspect file": ["inspect", weights],
        "inspect folder": ["inspect", model, "--layer", "0", "--scan"],
        "split file": ["split", "-w", weights, "--out", folder / "s.png"],
        "split folder": ["split", "-w", model, "--layer", "0"],
        "circuits folder": ["circuits", "-w", model, "--layer", "0", "--out", folder / "c.svg"],
        "heatmap file": ["heatmap", "a b c", "-w", weights, "--no-maps", "--no-stats",
                         "--out", folder / "h.png", "--html", folder / "h.html",
                         "--export", folder / "h.safetensors"],
    }
    for name, args in runs.items():
        result = cli(*args)
        assert result.exit_code == 0, (name, result.output[-1500:])
        assert "tokenizer" not in result.output, name
    made = sorted(set(p.name for p in folder.iterdir()) - set(before))
    assert made == ["c.svg", "h.html", "h.png", "h.safetensors", "s.png"]
    assert (folder / "h.png").read_bytes()[:4] == b"\x89PNG"


@needs_safe_pickles
def test_pickle_in_a_non_utf8_folder(cli, tmp_path):
    folder = _bad_folder(tmp_path, b"\xe9")
    path = folder / "train.pt"
    torch.manual_seed(0)
    state = torch.nn.TransformerEncoderLayer(8, 2, 16).state_dict()
    torch.save({"model": state, "epoch": 7}, paths.library_path(folder) / "train.pt")
    assert cli("inspect", path).exit_code == 0
    result = cli("split", "-w", path, "--layer", "0", "-H", "2")
    assert result.exit_code == 0, result.output


@pytest.mark.hf
def test_model_folder_with_bytes_on_argv(tmp_path):
    """The real argv path: bytes 0xff in the folder name, --model with every output."""
    pytest.importorskip("transformers")
    folder = _bad_folder(tmp_path)
    model = folder / "m"
    shutil.copytree(DISTILBERT, model)
    done = _run(["heatmap", "--model", model, "the cat sat", "--no-maps", "--no-stats",
                 "--out", folder / "o.png", "--html", folder / "o.html",
                 "--export", folder / "o.safetensors"])
    assert done.returncode == 0, done.stderr.decode()
    assert b"tokenizer" not in done.stderr and done.stderr == b""
    for name in ("o.png", "o.html", "o.safetensors"):
        assert (folder / name).stat().st_size > 100
    # the export's metadata names the folder by its escapes (the header is UTF-8 JSON)
    from safetensors import safe_open

    with safe_open(str(paths.library_path(folder) / "o.safetensors"), "pt") as f:
        assert "caf\\udcff" in f.metadata()["source"]
    circuits = _run(["circuits", "--model", model, "--layer", "0"])
    assert circuits.returncode == 0, circuits.stderr.decode()


@pytest.mark.hf
def test_negative_control_without_the_link_the_tokenizer_fails(cli, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import attnviz.sources.hf.load as hf_load

    folder = _bad_folder(tmp_path)
    model = folder / "m"
    shutil.copytree(DISTILBERT, model)
    assert cli("heatmap", "--model", model, "a b", "--no-maps", "--no-stats").exit_code == 0
    monkeypatch.setattr(hf_load, "library_path", lambda path: path)
    result = cli("heatmap", "--model", model, "a b", "--no-maps", "--no-stats")
    assert result.exit_code == 1 and "tokenizer" in result.output, result.output


def test_link_that_cannot_be_made_names_the_encoding(tmp_path, monkeypatch):
    folder = _bad_folder(tmp_path)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "symlink", refuse)
    monkeypatch.setattr(paths, "_LINKS", {})
    with pytest.raises(UsageError) as caught:
        paths.library_path(folder)
    what = caught.value.what
    assert "not UTF-8 text (byte 0xff at character" in what and "tokenizer" not in what
    assert "rename it to a UTF-8 name" in caught.value.fix


def test_library_path_leaves_utf8_paths_alone(tmp_path):
    folder = tmp_path / "café"
    folder.mkdir()
    assert paths.library_path(folder) == folder
    bad = _bad_folder(tmp_path)
    link = paths.library_path(bad)
    assert str(link).isascii() and os.path.samefile(link, bad)
    assert paths.library_path(bad) == link  # one link per folder


def test_model_error_is_one_line(cli, tmp_path):
    """A non-UTF-8 folder that is not a model: the usual one line, with the name escaped."""
    folder = _bad_folder(tmp_path)
    assert_clean_error(cli("heatmap", "--model", folder, "a b"), 1, "caf\\udcff")


@pytest.mark.hf
def test_language_model_heads_load_from_a_non_utf8_folder(cli, tmp_path):
    """generate and ablate load the model again with its LM head (their own
    from_pretrained): through the same link."""
    pytest.importorskip("transformers")
    folder = _bad_folder(tmp_path, b"\xe9")
    model = folder / "lm"
    shutil.copytree(SAMPLES / "models" / "phi3-tiny-lm", model)
    for command, extra in (("generate", ["--max-new-tokens", "2"]), ("ablate", [])):
        result = cli(command, "--model", model, "the cat sat on the mat", "--no-maps",
                     "--no-stats", *extra)
        assert result.exit_code == 0, (extra, result.output[-1500:])
        assert "tokenizer" not in result.stderr
    assert "LM head: Phi3ForCausalLM" in result.output  # the ablation did load the head
