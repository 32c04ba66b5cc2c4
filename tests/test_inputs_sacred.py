"""No output may touch an input: every file a run reads is resolved before any work (symlinks,
`..`, hard links, whole model folders), and signals during a write leave nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BUNDLED, ROOT, assert_clean_error
from safetensors.torch import save_file

from attnviz.app.outputs import atomic_output, check_output_path, read_set
from attnviz.errors import Interrupted, OutputError


def digest(folder: Path) -> dict[str, str]:
    """Name → sha256 of every file below folder (what must stay unchanged)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def mha_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in torch.nn.MultiheadAttention(8, 2).state_dict().items()}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A folder as --weights reads it: one checkpoint, a config and a vocabulary."""
    folder = tmp_path / "model"
    folder.mkdir()
    save_file(mha_tensors(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 2}))
    (folder / "vocab.txt").write_text("[UNK]\nthe\ncat\n")
    return folder


@pytest.fixture
def sharded_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "sharded"
    folder.mkdir()
    tensors = mha_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


# (description, arguments built from the folder, the fragment the error must carry)
FOLDER_CASES = [
    ("export over the checkpoint",
     lambda d: ["--weights", d, "--export", d / "model.safetensors"], "input file"),
    ("export over it through ..",
     lambda d: ["--weights", d, "--export", d / ".." / d.name / "model.safetensors"],
     "input file"),
    ("a new export inside the model folder",
     lambda d: ["--weights", d, "--export", d / "maps.safetensors"], "model folder"),
    ("a figure inside the model folder",
     lambda d: ["--weights", d, "--out", d / "fig.png"], "model folder"),
]


@pytest.mark.parametrize("case", FOLDER_CASES, ids=[c[0] for c in FOLDER_CASES])
def test_weights_folder_is_never_written(cli, model_dir, case):
    _, build, fragment = case
    before = digest(model_dir.parent)
    result = cli("heatmap", "a b", "-H", "2", *build(model_dir))
    assert_clean_error(result, 1, fragment)
    assert digest(model_dir.parent) == before


@pytest.mark.parametrize("shard", ["model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors",
                                   "model.safetensors.index.json"])
def test_shards_and_index_are_never_written(cli, sharded_dir, tmp_path, shard):
    before = digest(sharded_dir)
    # A symlink elsewhere that points at the shard: its resolved target is an input.
    link = tmp_path / "elsewhere.safetensors"
    link.symlink_to(sharded_dir / shard)
    for target in (sharded_dir / shard, link):
        if target.suffix != ".safetensors":
            continue
        assert_clean_error(cli("heatmap", "a b", "-H", "2", "--weights", sharded_dir,
                               "--export", target), 1, "input file")
    assert digest(sharded_dir) == before


def test_hard_link_to_the_checkpoint_is_refused(cli, tmp_path):
    weights = tmp_path / "w.safetensors"
    save_file(mha_tensors(), weights)
    alias = tmp_path / "alias.png"
    os.link(weights, alias)
    before = digest(tmp_path)
    assert_clean_error(cli("split", "--weights", weights, "-H", "2", "--png", alias), 1,
                       "link to it")
    assert_clean_error(cli("heatmap", "a b", "-H", "2", "--weights", weights, "--out", alias),
                       1, "link to it")
    assert digest(tmp_path) == before


def test_sentence_file_is_never_written(cli, tmp_path):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("the cat sat\n")
    link = tmp_path / "maps.safetensors"
    link.symlink_to(sentences)
    assert_clean_error(cli("heatmap", "--file", sentences, "--export", link), 1, "input file")
    assert sentences.read_text() == "the cat sat\n"


def test_bundled_model_is_never_written(cli, tmp_path):
    before = hashlib.sha256(BUNDLED.read_bytes()).hexdigest()
    link = tmp_path / "bundled.safetensors"
    link.symlink_to(BUNDLED)
    for target in (BUNDLED, link, BUNDLED.parent / ".." / "data" / BUNDLED.name):
        assert_clean_error(cli("heatmap", "a b", "--export", target), 1, "input file")
    assert hashlib.sha256(BUNDLED.read_bytes()).hexdigest() == before


def test_model_folder_is_never_written(cli, model_dir):
    """--model: the check runs before transformers loads anything (this folder is not even a
    loadable model), so the refusal cannot depend on the load."""
    before = digest(model_dir)
    for option, target in (("--export", model_dir / "model.safetensors"),
                           ("--out", model_dir / "x.png")):
        assert_clean_error(cli("heatmap", "a b", "--model", model_dir, option, target), 1,
                           "model folder" if option == "--out" else "input file")
    assert_clean_error(cli("split", "--model", model_dir, "--png", model_dir / "x.png"), 1,
                       "model folder")
    assert digest(model_dir) == before


def test_outputs_beside_inputs_still_work(cli, tmp_path, model_dir):
    """The negative control: the same run with its outputs outside the inputs succeeds."""
    out, export = tmp_path / "fig.png", tmp_path / "maps.safetensors"
    result = cli("heatmap", "the cat", "-H", "2", "--weights", model_dir, "--out", out,
                 "--export", export, "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0 and export.stat().st_size > 0


def test_read_set_compares_inodes_not_names(tmp_path):
    original = tmp_path / "a.safetensors"
    original.write_bytes(b"x")
    os.link(original, tmp_path / "b.safetensors")
    reads = read_set([original])
    with pytest.raises(OutputError, match="link"):
        check_output_path(tmp_path / "b.safetensors", (".safetensors",), reads)
    assert check_output_path(tmp_path / "c.safetensors", (".safetensors",), reads)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_during_write_leaves_nothing(tmp_path, sig):
    target = tmp_path / "out.safetensors"
    expected = KeyboardInterrupt if sig == signal.SIGINT else Interrupted
    with pytest.raises(expected):
        with atomic_output(target) as tmp:
            tmp.write_bytes(b"partial")
            os.kill(os.getpid(), sig)
    assert list(tmp_path.iterdir()) == []
    # The handlers are restored afterwards.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.slow
def test_cli_signal_during_export_exits_cleanly(tmp_path):
    """SIGTERM while the real CLI writes its export: one error line, exit 143, no file at all."""
    script = (
        "import os, signal, sys\n"
        "import safetensors.torch as st\n"
        "real = st.save_file\n"
        "def slow(tensors, path, metadata=None):\n"
        "    real(tensors, path, metadata=metadata)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "st.save_file = slow\n"
        "from attnviz.cli.main import main\n"
        "sys.argv = ['attnviz', 'heatmap', 'a b', '--export', sys.argv[1]]\n"
        "main()\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "maps.safetensors")],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: interrupted by SIGTERM; no partial output was left"]
    assert list(tmp_path.iterdir()) == []
