"""Pickle storages checked against their zip records: no tensor ever reads another's bytes.

Each hostile archive is written with torch's own zip writer (`PyTorchFileWriter`, the one
`torch.save` uses) around a `data.pkl` whose storage declarations and tensor views are chosen
here; the forged-directory variants then edit the zip's central directory by hand. Negative
controls: the same builder with honest declarations loads, and real `torch.save` checkpoints
with tied, shared and viewed storages load with the values torch itself loads.
"""

from __future__ import annotations

import collections
import pickle
import struct
from pathlib import Path

import pytest
import torch
from helpers import assert_clean_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnviz.errors import CheckpointError
from attnviz.load.checkpoint import load_pickle_tensors


class _Storage:
    """A storage declaration: key, element count, storage class."""

    def __init__(self, key: str | int, numel: int, cls: object = torch.FloatStorage) -> None:
        self.key, self.numel, self.cls = key, numel, cls


class _View:
    """A tensor as torch.save pickles it: a rebuild call over a declared storage."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (*self.args, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def _data_pkl(obj: object) -> bytes:
    import io

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_archive(path: Path, state: dict, records: dict[str, bytes]) -> Path:
    """A torch zip archive (torch's own writer) holding data.pkl for `state` and `records`."""
    writer = torch._C.PyTorchFileWriter(str(path))
    pkl = _data_pkl(state)
    writer.write_record("data.pkl", pkl, len(pkl))
    writer.write_record("byteorder", b"little", 6)
    for name, data in records.items():
        writer.write_record(f"data/{name}", data, len(data))
    writer.write_record("version", b"3\n", 2)
    writer.write_end_of_file()
    return path


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def repoint(path: Path, name: str, target: str) -> None:
    """Forge the central directory: entry `name` points at `target`'s local header."""
    blob = bytearray(path.read_bytes())
    entries: dict[str, int] = {}
    at = blob.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", blob, at + 28)[0]
        entry = bytes(blob[at + 46: at + 46 + name_len]).decode()
        entries[entry.split("/", 1)[1]] = at
        at = blob.find(b"PK\x01\x02", at + 46)
    target_header = struct.unpack_from("<I", blob, entries[target] + 42)[0]
    struct.pack_into("<I", blob, entries[name] + 42, target_header)
    path.write_bytes(bytes(blob))


def _two(path: Path, first: _Storage, second: _Storage, view_a: tuple, view_b: tuple,
         records: dict[str, bytes]) -> Path:
    state = {"a": _View(first, *view_a), "b": _View(second, *view_b)}
    return write_archive(path, state, records)


A = floats(1, 2, 3, 4)
B = floats(100, 200, 300, 400)

# name → builder(path); each builds one aliasing variant
HOSTILE = {
    # the case: a record shorter than its declaration reads the next record's bytes
    "short-record": lambda p: _two(p, _Storage("0", 8), _Storage("1", 4), (0, (8,), (1,)),
                                   (0, (4,), (1,)), {"0": A, "1": B}),
    "short-record-last": lambda p: _two(p, _Storage("0", 4), _Storage("1", 8), (0, (4,), (1,)),
                                        (0, (8,), (1,)), {"0": A, "1": B}),
    "long-record": lambda p: _two(p, _Storage("0", 2), _Storage("1", 4), (0, (2,), (1,)),
                                  (0, (4,), (1,)), {"0": A, "1": B}),
    "offset-past-record": lambda p: _two(p, _Storage("0", 4), _Storage("1", 4),
                                         (6, (4,), (1,)), (0, (4,), (1,)), {"0": A, "1": B}),
    "stride-past-record": lambda p: _two(p, _Storage("0", 4), _Storage("1", 4),
                                         (0, (2, 2), (5, 1)), (0, (4,), (1,)),
                                         {"0": A, "1": B}),
    "missing-record": lambda p: _two(p, _Storage("0", 4), _Storage("7", 4), (0, (4,), (1,)),
                                     (0, (4,), (1,)), {"0": A, "1": B}),
    "one-key-two-dtypes": lambda p: _two(p, _Storage("0", 4), _Storage("0", 8, torch.HalfStorage),
                                         (0, (4,), (1,)), (0, (8,), (1,)), {"0": A}),
    "int-and-str-key": lambda p: _two(p, _Storage("0", 4), _Storage(0, 4), (0, (4,), (1,)),
                                      (0, (4,), (1,)), {"0": A}),
}

# forged directories: the pickle is honest, the zip makes two records share bytes
FORGED = {"two-storages-one-record": ("data/1", "data/0"),
          "storage-on-data.pkl": ("data/0", "data.pkl"),
          "pickle-on-storage": ("data.pkl", "data/1")}


def _honest(path: Path) -> Path:
    return _two(path, _Storage("0", 4), _Storage("1", 4), (0, (4,), (1,)), (0, (4,), (1,)),
                {"0": A, "1": B})


def test_honest_builder_loads(tmp_path):
    """Negative control: the builder's honest archive loads, with the values written."""
    tensors = load_pickle_tensors(_honest(tmp_path / "honest.pt"))
    assert torch.equal(tensors["a"], torch.tensor([1.0, 2, 3, 4]))
    assert torch.equal(tensors["b"], torch.tensor([100.0, 200, 300, 400]))


def test_torch_alone_reads_foreign_bytes(tmp_path):
    """Why the check exists: torch.load(mmap=True) serves the short record from b's bytes."""
    path = HOSTILE["short-record"](tmp_path / "short.pt")
    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    assert loaded["a"][4:].tolist() != [0.0] * 4  # not a's data: whatever follows its record
    assert torch.isfinite(loaded["a"]).sum() >= 4


@pytest.mark.parametrize("variant", sorted(HOSTILE))
def test_aliasing_variants_refused(tmp_path, variant):
    path = HOSTILE[variant](tmp_path / f"{variant}.pt")
    with pytest.raises(CheckpointError) as caught:
        load_pickle_tensors(path)
    assert "not a safe PyTorch zip checkpoint" in caught.value.what


@pytest.mark.parametrize("variant", sorted(FORGED))
def test_forged_directories_refused(tmp_path, variant):
    name, target = FORGED[variant]
    path = _honest(tmp_path / f"{variant}.pt")
    repoint(path, name, target)
    with pytest.raises(CheckpointError) as caught:
        load_pickle_tensors(path)
    assert "share bytes" in caught.value.what or "two readings" in caught.value.what


def test_forged_directory_fools_torch_alone(tmp_path):
    """Why the overlap check exists: torch serves b from a's bytes when the directory says so."""
    path = _honest(tmp_path / "forged.pt")
    repoint(path, "data/1", "data/0")
    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    assert torch.equal(loaded["b"], loaded["a"])


@pytest.fixture
def real_checkpoints(tmp_path):
    """torch.save outputs with tied weights, views, transposes, dtypes, nesting, empties."""
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    tied = {"embed.weight": base, "lm_head.weight": base, "row": base[2],
            "col": base[:, 1], "t": base.t(), "tail": base.view(-1)[20:],
            "half": torch.randn(3, 5).half(), "bf16": torch.randn(2, 3).bfloat16(),
            "empty": torch.empty(0, 4), "param": torch.nn.Parameter(torch.randn(3))}
    paths = {"tied": tmp_path / "tied.pt", "nested": tmp_path / "nested.pt",
             "mha": tmp_path / "mha.pt"}
    torch.save(tied, paths["tied"])
    torch.save({"state_dict": {"model": tied}}, paths["nested"])
    torch.save(torch.nn.MultiheadAttention(8, 2).state_dict(), paths["mha"])
    return paths


@pytest.mark.parametrize("name", ["tied", "nested", "mha"])
def test_real_checkpoints_still_load(real_checkpoints, name):
    path = real_checkpoints[name]
    ours = load_pickle_tensors(path)
    reference = torch.load(path, map_location="cpu", weights_only=False)
    while set(ours) != {k for k, v in reference.items() if isinstance(v, torch.Tensor)}:
        reference = next(v for v in reference.values() if isinstance(v, dict))
    for key, tensor in ours.items():
        assert torch.equal(tensor, reference[key]), key


def _mha_archive(path: Path, short: bool) -> Path:
    """An nn.MultiheadAttention(8, 2) state dict; `short` cuts in_proj_weight's record."""
    torch.manual_seed(0)
    state = {k: v.detach().contiguous() for k, v in
             torch.nn.MultiheadAttention(8, 2).state_dict().items()}
    storages, records = {}, {}
    for index, (key, tensor) in enumerate(state.items()):
        data = tensor.numpy().tobytes()
        storages[key] = _View(_Storage(str(index), tensor.numel()), 0, tuple(tensor.shape),
                              tuple(tensor.stride()))
        records[str(index)] = data[: len(data) // 2] if short and key == "in_proj_weight" \
            else data
    return write_archive(path, storages, records)


def test_split_proof_no_longer_passes_on_foreign_data(cli, tmp_path):
    """split's proof (nn.MultiheadAttention vs. the slices) passed on a short record's foreign
    bytes, since both sides read the same wrong W_q; now the file is refused first."""
    honest = _mha_archive(tmp_path / "honest.pt", short=False)
    result = cli("split", "--weights", honest, "-H", "2")
    assert result.exit_code == 0, result.output  # negative control: the honest archive proves
    assert "✓ equal to float32 round-off" in result.stdout
    hostile = _mha_archive(tmp_path / "short.pt", short=True)
    loaded = torch.load(hostile, map_location="cpu", weights_only=True, mmap=True)
    assert loaded["in_proj_weight"].shape == (24, 8)  # torch alone loads it, half foreign
    before = sorted(tmp_path.iterdir())
    assert_clean_error(cli("split", "--weights", hostile, "-H", "2"), 1,
                       "declares", "its record holds")
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.slow
def test_deep_pickle_is_a_clean_error(tmp_path):
    """A dict nested 100,000 deep under "model" keys: no RecursionError, one clear refusal."""
    blob = b"\x80\x02" + b"}q\x00(X\x05\x00\x00\x00model" * 100_000 + b"}" + b"u" * 100_000 + b"."
    path = tmp_path / "deep.pt"
    writer = torch._C.PyTorchFileWriter(str(path))
    writer.write_record("data.pkl", blob, len(blob))
    writer.write_end_of_file()
    with pytest.raises(CheckpointError) as caught:
        load_pickle_tensors(path)
    assert "no tensors" in caught.value.what


def _legacy_patched(path: Path, field: str, value: int) -> Path:
    """A legacy-format (non-zip) torch.save of a view, one pickle integer changed in place."""
    import io
    import pickletools

    torch.save({"v": torch.arange(6.0)[2:4]}, path, _use_new_zipfile_serialization=False)
    blob = bytearray(path.read_bytes())
    stream = io.BytesIO(bytes(blob))
    for _ in range(3):  # magic number, protocol, system info
        pickle.load(stream)
    start = stream.tell()
    ops = list(pickletools.genops(bytes(blob[start:])))
    persid = next(i for i, (op, _, _) in enumerate(ops) if op.name == "BINPERSID")
    op, arg, pos = ops[persid - 4] if field == "numel" else ops[persid + 1]
    assert op.name == "BININT1" and arg in (6, 2), (op.name, arg)
    blob[start + pos + 1] = value
    path.write_bytes(bytes(blob))
    return path


@pytest.mark.parametrize("field", ["numel", "offset"])
def test_legacy_format_declarations_checked(tmp_path, field):
    """The legacy format reads each storage with its own size header: torch refuses a
    declaration that disagrees (negative control: the unpatched file loads)."""
    honest = _legacy_patched(tmp_path / "honest.pt", field, 6 if field == "numel" else 2)
    assert torch.equal(load_pickle_tensors(honest)["v"], torch.tensor([2.0, 3.0]))
    with pytest.raises(CheckpointError):
        load_pickle_tensors(_legacy_patched(tmp_path / "legacy.pt", field, 200))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["0", "1"]), numel=st.integers(0, 9), offset=st.integers(0, 9),
       size=st.lists(st.integers(0, 5), min_size=1, max_size=2),
       stride=st.lists(st.integers(0, 5), min_size=2, max_size=2))
def test_any_declaration_reads_only_its_own_record(tmp_path, key, numel, offset, size, stride):
    """Whatever a pickle declares over two honest records: either a clean refusal, or every
    value read is the value at that position of the tensor's own record."""
    import numpy as np

    stride = stride[: len(size)]
    path = tmp_path / f"p{key}{numel}{offset}{size}{stride}.pt"
    records = {"0": A, "1": B}
    write_archive(path, {"t": _View(_Storage(key, numel), offset, tuple(size), tuple(stride)),
                         "other": _View(_Storage("1" if key == "0" else "0", 4), 0, (4,), (1,))},
                  records)
    try:
        tensor = load_pickle_tensors(path)["t"]
    except CheckpointError:
        return
    own = np.frombuffer(records[key], dtype="<f4")
    index = np.full(tuple(size), offset)
    for axis, (length, step) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[axis] = length
        index = index + (np.arange(length) * step).reshape(shape)
    assert index.size == 0 or index.max() < len(own)
    np.testing.assert_array_equal(tensor.numpy(), own[index])
