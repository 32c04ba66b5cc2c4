"""What the process is doing inside third-party code, kept where a supervising parent can read
it if the process dies of a signal (a Rust allocator abort, a segfault in a C extension).

The command line runs its work in a child process (cli/supervisor.py). Before the fork it calls
`share()`: one page of anonymous shared memory, and one unlinked file that silenced stderr goes
to. Inside the child, `doing(what, fix, where)` records the step around every call into a
library that could kill the process; if the child dies of a signal, the parent reads the step
and the library's last line on stderr and prints one `error:` line. Without a supervisor (the
Python API) `doing` costs one dictionary write and `shared_sink()` is None.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

_PAGE = 4096
_HEADER = struct.Struct("<I")
_state: dict[str, Any] = {"page": None, "sink": None, "stack": []}


def share() -> None:
    """Create the shared page and the stderr sink (before the fork; the child inherits both)."""
    import mmap
    import tempfile

    _state["page"] = mmap.mmap(-1, _PAGE)  # anonymous and MAP_SHARED: the parent sees writes
    sink = tempfile.TemporaryFile()
    _state["sink"] = sink  # kept open: the file object owns the descriptor


def shared_sink() -> int | None:
    """The descriptor silenced stderr should go to (the parent reads its tail), or None."""
    sink = _state["sink"]
    return None if sink is None else int(sink.fileno())


def _write(note: dict[str, str] | None) -> None:
    page = _state["page"]
    if page is None:
        return
    data = b"" if note is None else json.dumps(note).encode()[: _PAGE - _HEADER.size]
    page[_HEADER.size:_HEADER.size + len(data)] = data
    page[:_HEADER.size] = _HEADER.pack(len(data))


@contextlib.contextmanager
def doing(what: str, fix: str = "", where: str = "") -> Iterator[None]:
    """Record `what` (and how to fix it, and which file) for the time of the block."""
    stack: list[dict[str, str]] = _state["stack"]
    stack.append({"what": what, "fix": fix, "where": where})
    _write(stack[-1])
    try:
        yield
    finally:
        stack.pop()
        _write(stack[-1] if stack else None)


def read() -> dict[str, str] | None:
    """The step recorded last (in the parent, after the child died), or None."""
    page = _state["page"]
    if page is None:
        return None
    (size,) = _HEADER.unpack(page[:_HEADER.size])
    if not 0 < size <= _PAGE - _HEADER.size:
        return None
    try:
        note = json.loads(bytes(page[_HEADER.size:_HEADER.size + size]).decode())
    except ValueError:
        return None
    return {k: str(v) for k, v in note.items()} if isinstance(note, dict) else None


def last_words(limit: int = 1 << 16) -> str:
    """The last line a library wrote to silenced stderr that says why it died (Rust's
    "memory allocation of N bytes failed", a panic's message), else its last line; ''."""
    fd = shared_sink()
    if fd is None:
        return ""
    try:
        size = os.fstat(fd).st_size
        tail = os.pread(fd, limit, max(0, size - limit))
    except OSError:
        return ""
    lines = [line.strip() for line in tail.decode("utf-8", "replace").splitlines()
             if line.strip()]
    for word in _TELLING:  # the most telling kind of line first
        telling = [line for line in lines if word in line]
        if telling:
            return telling[-1]
    return lines[-1] if lines else ""


# words of the lines that say why a library died, most telling first (Rust's allocator and
# panic messages, then C's)
_TELLING = ("memory allocation of", "panicked at", "Fatal", "fatal", "rror", "abort")
