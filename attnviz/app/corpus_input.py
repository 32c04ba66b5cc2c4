"""A corpus read as a stream of examples: lines of a text file, a string field of JSON lines,
or standard input ('-'), one example at a time (never the whole file in memory); `--sample N`
draws N examples by reservoir sampling (one pass, N kept); `--limit N` stops after N. Each
example gets an ordinal (its place in the stream, or in the sample), which decides its rank
(ordinal % world), its bootstrap weights and its band of the settle curve; `windows` groups
the stream into lookahead windows that the batcher sorts by length (`buckets`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnviz.errors import AttnvizError, UsageError, option, printable, printable_path

MAX_LINE_BYTES = 1 << 20  # a longer line is cut here (its tail is never an example's start)
CORPUS_FIX = "pass a UTF-8 text file (one example per line) or JSON lines with --field"


@dataclass(frozen=True)
class Example:
    ordinal: int  # its place in the stream (or the sample), from 0
    text: str


def where_of(path: Path) -> str:
    return "standard input" if str(path) == "-" else printable_path(path)


def read_texts(path: Path, field: str | None = None) -> Iterator[str]:
    """Each example's text: every non-blank line, or with `field` that field of each JSON
    line (a line that is not a JSON object with a string there is an error naming it)."""
    where = where_of(path)
    with _open(path, where) as f:
        number, first = 0, True
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise UsageError(f"cannot read the corpus: {exc.strerror}", fix=CORPUS_FIX,
                                 where=where) from None
            if not raw:
                return
            number += 1
            cut = len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n")
            if cut:  # an over-long line: its first MiB (tokens are cut long before)
                _skip_rest(f)
                raw = raw[:MAX_LINE_BYTES]
            try:  # a cut line may end inside a character
                text = raw.decode("utf-8", errors="ignore" if cut else "strict").strip()
            except UnicodeDecodeError as exc:
                raise AttnvizError(f"line {number} of the corpus is not UTF-8 text (byte "
                                   f"{exc.start + 1} of the line)", fix=CORPUS_FIX,
                                   where=where) from None
            if not text:
                continue
            yield text if field is None else _field(text, field, number, where, first)
            first = False


def _open(path: Path, where: str) -> contextlib.AbstractContextManager[Any]:
    """The corpus as a binary stream ('-': standard input, left open); a folder or an
    unreadable path is an error."""
    if str(path) == "-":
        return contextlib.nullcontext(sys.stdin.buffer)
    if path.is_dir():
        raise UsageError("the corpus is a folder", fix=CORPUS_FIX, where=where)
    try:
        return open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read the corpus: {exc.strerror}", fix=CORPUS_FIX,
                         where=where) from None


def _skip_rest(f: Any) -> None:
    while True:
        chunk = f.readline(MAX_LINE_BYTES)
        if not chunk or chunk.endswith(b"\n"):
            return


def _field(text: str, field: str, number: int, where: str, first: bool) -> str:
    """The field's text. On the first example a failure is the option's (a text file, or the
    wrong name: a usage error naming it); later, a bad line is bad data."""
    error = UsageError if first else AttnvizError
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise error(f"line {number} of the corpus is not JSON, as {option('field')} expects",
                    fix=f"drop {option('field')} for a text file", where=where,
                    **({"option": "field"} if first else {})) from None
    value = doc.get(field) if isinstance(doc, dict) else None
    if not isinstance(value, str):
        raise error(f"line {number} of the corpus has no string field "
                    f"{printable(field, 40)!r} ({option('field')})",
                    fix=f"name the field that holds the text with {option('field')}",
                    where=where, **({"option": "field"} if first else {}))
    return value


def reservoir(texts: Iterable[str], size: int, seed: int) -> list[str]:
    """A uniform sample of `size` texts in one pass (Algorithm R), kept in stream order."""
    rng = random.Random(seed)
    kept: list[tuple[int, str]] = []
    for i, text in enumerate(texts):
        if i < size:
            kept.append((i, text))
        else:
            j = rng.randint(0, i)
            if j < size:
                kept[j] = (i, text)
    return [text for _, text in sorted(kept)]


def examples(path: Path, field: str | None, limit: int | None, sample: int | None,
             seed: int) -> Iterator[Example]:
    """The corpus's examples with their ordinals (sampled, then limited)."""
    texts: Iterable[str] = read_texts(path, field)
    if sample is not None:
        texts = reservoir(texts, sample, seed)
    for ordinal, text in enumerate(texts):
        if limit is not None and ordinal >= limit:
            return
        yield Example(ordinal, text)


class PrefixHash:
    """A running hash of the examples read, in order: a resumed run compares its prefix."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.count = 0

    def add(self, text: str) -> None:
        data = text.encode("utf-8", errors="surrogatepass")
        self._hash.update(len(data).to_bytes(8, "little") + data)
        self.count += 1

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def windows(stream: Iterable[Example], size: int) -> Iterator[list[Example]]:
    """The stream in lookahead windows of `size` examples (the last may be shorter)."""
    window: list[Example] = []
    for example in stream:
        window.append(example)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def buckets(items: list[Any], length: Callable[[Any], int], cost: Callable[[int, int], int],
            budget: int, max_batch: int) -> list[list[Any]]:
    """Items sorted by length and cut into batches whose cost(batch size, longest) stays
    within the budget (a lone item is a batch even above it), at most max_batch each: padding
    stays small because neighbours have similar lengths."""
    ordered = sorted(items, key=length)
    out: list[list[Any]] = []
    batch: list[Any] = []
    for item in ordered:
        if batch and (len(batch) >= max_batch or cost(len(batch) + 1, length(item)) > budget):
            out.append(batch)
            batch = []
        batch.append(item)
    if batch:
        out.append(batch)
    return out


def corpus_identity(path: Path) -> dict[str, Any]:
    """What names a corpus file for a resume check: its path, size and modification time (a
    stream has its path alone; the prefix hash checks what was read)."""
    if str(path) == "-" or not path.is_file():
        return {"path": str(path)}
    info = os.stat(path)
    return {"path": str(path.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}
