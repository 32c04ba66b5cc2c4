"""Inputs are read within bounds: an endless or oversized sentence file stops at its limit,
non-files are refused, and only the embedding rows and vocabulary the tokens need are read.

The contract every case asserts is in tests/hostile.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hostile import (
    DEEP,
    Result,
    assert_error,
    assert_printed_clean,
    digest,
    mha_state,
    one_thread,  # noqa: F401 - autouse: torch on one thread
)

# ------------------------------------------------------------------------------------------
# 4. Inputs read within bounds


@pytest.mark.parametrize("name", ["dev-zero", "dev-zero-long-lines"])
def test_endless_sentence_file_stops_at_the_limit_under_a_memory_cap(capped, name):
    """/dev/zero is one endless line: refused after max(64 KiB, 64 bytes per --budget tokens)."""
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
    ("too many lines", b"the cat sat\n" * 100, ["--budget", "sentences=3"],
     "the sentence file holds more than 3 sentences"),
    ("too many with arguments", b"a b\n" * 10, ["--budget", "sentences=4", "x", "y"],
     "holds more than 2 sentences besides the 2 given"),
    ("a line over --budget tokens", b"a b\n" + b"w " * 50 + b"\n" + b"\xff" * 10,
     ["--budget", "tokens=20"], "sentence 2 (line 2) has 50 tokens, more than --budget tokens 20"),
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
    from attnviz.load import store

    folder = vocab_folder(tmp_path, ["[UNK]", "the", "cat", "sat"])
    reads, rows = [], []
    real_read, real_rows = store.TensorStore.read, store.TensorStore.read_rows
    monkeypatch.setattr(store.TensorStore, "read",
                        lambda self, name: reads.append(name) or real_read(self, name))
    monkeypatch.setattr(store.TensorStore, "read_rows", lambda self, name, a, b: (
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

    from attnviz.compute.forward_pass import inputs

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
