"""Hostile and broken checkpoints: one clean error line, no code run, nothing written."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import assert_clean_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from attnviz.core.request import HeadHints
from attnviz.errors import AttnvizError
from attnviz.load.checkpoint import open_checkpoint
from attnviz.recognize import find_layers


def _st_bytes(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + data


F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
MALFORMED_SAFETENSORS = {
    "empty": b"",
    "short-prefix": b"\x01\x02",
    "header-too-long": struct.pack("<Q", 10**12) + b"{}",
    "header-past-end": struct.pack("<Q", 100) + b"{}",
    "not-json": _st_bytes(b"{nope"),
    "not-utf8": _st_bytes(b"\xff\xfe{}"),
    "not-object": _st_bytes([1, 2]),
    "bad-dtype": _st_bytes({"w": {**F32, "dtype": "Q7"}}, b"\0" * 16),
    "bad-shape": _st_bytes({"w": {**F32, "shape": [-2, 2]}}, b"\0" * 16),
    "offsets-out-of-range": _st_bytes({"w": {**F32, "data_offsets": [0, 64]}}, b"\0" * 16),
    "reversed-offsets": _st_bytes({"w": {**F32, "data_offsets": [16, 0]}}, b"\0" * 16),
    "shape-size-mismatch": _st_bytes({"w": {**F32, "shape": [3, 3]}}, b"\0" * 16),
    "overlap": _st_bytes({"a": F32, "b": {**F32, "data_offsets": [8, 24]}}, b"\0" * 24),
    "gap": _st_bytes({"a": {**F32, "data_offsets": [8, 24]}}, b"\0" * 24),
    "trailing-bytes": _st_bytes({"a": F32}, b"\0" * 20),
    "bad-metadata": _st_bytes({"__metadata__": {"a": 1}, "w": F32}, b"\0" * 16),
    "entry-not-object": _st_bytes({"w": 3}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_SAFETENSORS))
@pytest.mark.parametrize("command", ["inspect", "split"])
def test_malformed_safetensors(cli, tmp_path, name, command):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(MALFORMED_SAFETENSORS[name])
    args = [path] if command == "inspect" else ["--weights", path, "-H", "2"]
    before = sorted(tmp_path.iterdir())
    assert_clean_error(cli(command, *args), 1, "safetensors")
    assert sorted(tmp_path.iterdir()) == before
    assert path.read_bytes() == MALFORMED_SAFETENSORS[name]


def test_non_float_attention_weights_refused(cli, tmp_path):
    path = tmp_path / "int.safetensors"
    save_file({"in_proj_weight": torch.zeros(12, 4, dtype=torch.int64),
               "out_proj.weight": torch.zeros(4, 4, dtype=torch.int64)}, path)
    assert_clean_error(cli("inspect", path), 1, "not a floating-point type")


def test_hostile_names_are_escaped(cli, tmp_path):
    path = tmp_path / "names.safetensors"
    evil = "\x1b[31mattn\n.in_proj_weight"
    save_file({evil: torch.zeros(3, 1), "x": torch.zeros(1)}, path)
    result = cli("inspect", path)
    assert result.exit_code == 0
    assert "\x1b[31m" not in result.stdout


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_not_a_regular_file(cli, tmp_path, kind):
    path = tmp_path / "x.safetensors"
    if kind == "directory":
        path.mkdir()
        (path / "inner.txt").write_text("hi")
        code, fragment = 1, "checkpoint files"
    else:
        os.mkfifo(path)
        code, fragment = 1, "not a regular file"
    assert_clean_error(cli("inspect", path), code, fragment)


class Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("layout", ["zip", "legacy", "raw-pickle"])
@pytest.mark.parametrize("force_unsafe_env", [False, True])
def test_pickle_payload_never_runs(cli, tmp_path, monkeypatch, layout, force_unsafe_env):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    obj = {"in_proj_weight": torch.zeros(12, 4), "evil": Payload(marker)}
    if layout == "zip":
        torch.save(obj, path)
    elif layout == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps(obj))
    if force_unsafe_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    result = cli("inspect", path)
    assert_clean_error(result, 1, "refused to unpickle")
    assert "system" in result.stderr  # names the disallowed global
    assert "safetensors" in result.stderr
    assert not marker.exists()


def test_zip_bomb_is_refused_before_decompression(cli, tmp_path):
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * 50_000_000)
    assert path.stat().st_size < 1_000_000
    assert_clean_error(cli("inspect", path), 1, "compressed")


def test_zip_with_escaping_names_is_refused(cli, tmp_path):
    path = tmp_path / "escape.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("../../etc/evil", b"x")
    assert_clean_error(cli("inspect", path), 1, "entry name")


@pytest.mark.parametrize("content", [b"", b"\x80\x05garbage", os.urandom(64)])
def test_damaged_pickles(cli, tmp_path, content):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    assert_clean_error(cli("inspect", path), 1)


def test_sharded_index_escaping_the_folder(cli, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    outside = tmp_path / "secret.safetensors"
    save_file({"x": torch.zeros(1)}, outside)
    for shard in ("../secret.safetensors", "/etc/passwd", "missing.safetensors"):
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a.in_proj_weight": shard}}))
        result = cli("inspect", folder)
        assert_clean_error(result, 1)


def test_shard_lacking_promised_tensor(cli, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"other": torch.zeros(1)}, folder / "a.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"self_attn.in_proj_weight": "a.safetensors",
                                   "self_attn.out_proj.weight": "a.safetensors"}}))
    assert_clean_error(cli("inspect", folder), 1, "lacks tensor")


@pytest.mark.parametrize("text", ["{", "[1]", '{"num_attention_heads": "twelve"}'])
def test_bad_config_json(cli, tmp_path, text):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    save_file({"encoder.layer.0.attention.self.query.weight": torch.zeros(4, 4)},
              folder / "model.safetensors")
    assert_clean_error(cli("inspect", folder), 1, "config.json")


def test_output_paths_are_checked(cli, tmp_path):
    weights = tmp_path / "mha.safetensors"
    save_file({k: v.contiguous() for k, v in torch.nn.MultiheadAttention(8, 2).state_dict()
               .items()}, weights)
    original = weights.read_bytes()
    (tmp_path / "folder.png").mkdir()
    assert_clean_error(cli("split", "--png", tmp_path / "folder.png"), 1, "is a folder")
    assert_clean_error(cli("split", "--png", tmp_path / "nowhere" / "x.png"), 1,
                       "does not exist")
    weights_as_png = tmp_path / "w.png"
    weights_as_png.write_bytes(b"")
    assert_clean_error(cli("heatmap", "--weights", weights_as_png, "a b", "--out",
                           weights_as_png), 1)
    assert weights.read_bytes() == original


# ------------------------------------------------------------------------------------------
# property-based: every outcome is success or attnviz's own clean error


def _open_and_recognize(path: Path) -> None:
    try:
        store = open_checkpoint(path)
        inventory = find_layers(store, HeadHints(num_heads=2))
        for key in store.keys()[:4]:
            store.read(key)
        for layer in inventory.layers:
            from attnviz.compute.forward_pass.forward import load_weights

            load_weights(layer, store)
    except AttnvizError as exc:
        assert "\n" not in exc.one_line()


header_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "X9", 3]),
    "shape": st.lists(st.integers(-2, 6), max_size=3),
    "data_offsets": st.lists(st.integers(-4, 200), min_size=0, max_size=3),
})


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.dictionaries(st.sampled_from(["in_proj_weight", "in_proj_bias",
                                                "out_proj.weight", "out_proj.bias", "x"]),
                               header_entry, max_size=5),
       data=st.binary(max_size=200))
def test_generated_headers_fail_cleanly(tmp_path, entries, data):
    path = tmp_path / "gen.safetensors"
    path.write_bytes(_st_bytes(entries, data))
    _open_and_recognize(path)


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in torch.nn.MultiheadAttention(4, 2).state_dict().items()}
    save_file(state, folder / "mha.safetensors")
    torch.save(state, folder / "mha.pt")
    return {p.suffix: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_truncation_at_every_offset(tmp_path, small_checkpoints, suffix):
    blob = small_checkpoints[suffix]
    step = 1 if suffix == ".safetensors" else 7
    for cut in range(0, len(blob), step):
        path = tmp_path / f"cut{cut}{suffix}"
        path.write_bytes(blob[:cut])
        _open_and_recognize(path)
        path.unlink()


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1,
                      max_size=4),
       suffix=st.sampled_from([".safetensors", ".pt"]))
def test_bit_flips(tmp_path, small_checkpoints, flips, suffix):
    blob = bytearray(small_checkpoints[suffix])
    for position, bit in flips:
        blob[position % len(blob)] ^= 1 << bit
    path = tmp_path / f"flipped{suffix}"
    path.write_bytes(bytes(blob))
    _open_and_recognize(path)


def test_hub_cache_symlinks_are_followed_but_nothing_else(cli, tmp_path):
    import shutil

    from helpers import SAMPLES

    snapshot = tmp_path / "models--x--y" / "snapshots" / "abc"
    blobs = tmp_path / "models--x--y" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for source in (SAMPLES / "llama-sharded-tiny").iterdir():
        shutil.copy(source, blobs / source.name)
        (snapshot / source.name).symlink_to(Path("../../blobs") / source.name)
    result = cli("inspect", snapshot, "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["layers"]) == 2
    elsewhere = tmp_path / "plain"
    elsewhere.mkdir()
    for source in (SAMPLES / "llama-sharded-tiny").iterdir():
        (elsewhere / source.name).symlink_to(blobs / source.name)
    assert_clean_error(cli("inspect", elsewhere), 1, "resolves outside the folder")


def test_unicode_sentences_and_misuse_of_every_command(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("heatmap", "--random", "naïve café 東京 😀 δ-test", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"][0][:3] == ["naïve", "café", "東京"]
    assert_clean_error(cli("inspect", "missing.safetensors"), 2, "no such file")
    assert_clean_error(cli("inspect"), 2, "Missing argument")
    assert_clean_error(cli("inspect", tmp_path, "--layer", "0"), 1, "0 checkpoint files")
    assert_clean_error(cli("split", "-H", "nope"), 2, "--num-heads")
    assert_clean_error(cli("heatmap", "--random", "x " * 300), 2, "--budget tokens")
    assert_clean_error(cli("heatmap", "--random", "a", "--device", "mps"), 2, "MPS")
    assert_clean_error(cli("nosuchcommand"), 2, "No such command")
    assert list(tmp_path.iterdir()) == []


def test_zip_needing_an_unknown_version_is_refused_cleanly(cli, tmp_path):
    """Found by test_bit_flips: zipfile raises NotImplementedError for a 'version needed to
    extract' it does not know (here 6.4); that is a damaged checkpoint, not a crash."""
    import io
    import struct

    buffer = io.BytesIO()
    torch.save({"in_proj_weight": torch.zeros(6, 2)}, buffer)
    data = bytearray(buffer.getvalue())
    entry = data.find(b"PK\x01\x02")  # the first central-directory entry
    data[entry + 6 : entry + 8] = struct.pack("<H", 64)
    path = tmp_path / "v64.pt"
    path.write_bytes(bytes(data))
    assert_clean_error(cli("inspect", path), 1, "damaged zip directory")
