"""Paths from the command line, checked before any system call sees them, and stat'ed in
attnviz's own words (a name too long, a symbolic link loop, a missing file)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from attnviz.errors import UsageError, from_os_error, printable_path

MAX_PATH_BYTES = 4096  # Linux PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX of every common file system


def check_path_text(text: str | os.PathLike[str], option: str) -> None:
    """Refuse a path no file system can hold (an over-long name, a NUL byte) as a usage error."""
    shown = printable_path(text)
    try:
        raw = os.fsencode(text)
    except (UnicodeEncodeError, TypeError):
        raise UsageError(f"the path given to {option} cannot be encoded for this file system",
                         fix="use another name", where=shown) from None
    if b"\0" in raw:
        raise UsageError(f"the path given to {option} contains a NUL byte", fix="use another name",
                         where=shown)
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if len(raw) > MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        raise UsageError(f"the path given to {option} is too long ({len(raw)} bytes, a name of "
                         f"{longest})", fix=f"paths hold at most {MAX_PATH_BYTES} bytes and "
                         f"{MAX_NAME_BYTES} per name", where=shown)


def stat_input(path: Path, what: str = "the input") -> os.stat_result:
    """os.stat of an input, following links: a missing path is a usage error, a symbolic link
    loop or a permission problem a clear error naming the path."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise UsageError("no such file or folder", fix="check the path",
                             where=printable_path(path)) from None
        if exc.errno == errno.ELOOP:
            error = from_os_error(exc, f"cannot open {what}: it is a symbolic link loop")
        else:
            error = from_os_error(exc, f"cannot open {what}")
        raise error from None


def is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def read_capped(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (a FIFO, a device or a folder named
    like a vocabulary is refused before it is opened; a file growing while read is cut off)."""
    from attnviz.errors import CheckpointError

    st = stat_input(path, what)
    if not is_regular(st):
        raise CheckpointError(f"{what} is not a regular file", fix="replace it with the real file",
                              where=printable_path(path))
    if st.st_size > limit:
        raise CheckpointError(f"{what} holds {st.st_size} bytes, more than the {limit}-byte "
                              "limit", fix="check that it is the right file",
                              where=printable_path(path))
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise from_os_error(exc, f"cannot read {what}") from None
    if len(data) > limit:
        raise CheckpointError(f"{what} grew past the {limit}-byte limit while being read",
                              where=printable_path(path))
    return data


_OPENED: dict[str, int] = {}  # non-UTF-8 paths opened for native readers, kept open


def native_path(path: Path) -> str:
    """`path` as a str that Rust and C++ readers (safetensors, torch's zip reader) accept.

    A file name that is not UTF-8 (an old Latin-1 name) reaches Python with surrogates that
    those bindings cannot convert; it is then opened here, once, and passed as
    /proc/self/fd/N: the same file, whatever its name."""
    text = str(path)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        if not os.path.isdir("/proc/self/fd"):
            return text  # the reader will say it cannot open it
    if text not in _OPENED:
        _OPENED[text] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    return f"/proc/self/fd/{_OPENED[text]}"


_LINKS: dict[str, Path] = {}  # non-UTF-8 folders → their ASCII-named links, one per process


def library_path(path: Path) -> Path:
    """`path` as a path transformers and tokenizers accept.

    A folder whose name is not UTF-8 (`caf\\xe9/`) reaches Python as a str with surrogate
    escapes; transformers joins file names onto it and the tokenizers library (Rust) cannot
    convert it, which it reports as a broken tokenizer. Such a folder is reached instead through
    a symbolic link with an ASCII name in a private temporary folder (mode 0700, removed at
    exit): the same files, and the libraries never see the undecodable bytes. Links are made
    once per folder; a link that cannot be made is one clear error naming the encoding."""
    text = str(path)
    try:
        text.encode("utf-8")
        return path
    except UnicodeEncodeError:
        pass
    if text in _LINKS:
        return _LINKS[text]
    import atexit
    import shutil
    import tempfile

    try:
        private = tempfile.mkdtemp(prefix="attnviz-path-")
        atexit.register(shutil.rmtree, private, True)  # removes the link, never its target
        link = Path(private) / ("model" + path.suffix.encode("ascii", "replace").decode()
                                .replace("?", "_"))
        os.symlink(os.fsencode(os.path.abspath(path)), link)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"the path is not UTF-8 text ({_first_bad_byte(text)}), which the model "
                         f"libraries cannot open, and no ASCII-named link to it could be made "
                         f"({type(exc).__name__})",
                         fix="rename it to a UTF-8 name (convmv converts Latin-1 names)",
                         where=printable_path(path)) from None
    _LINKS[text] = link
    return link


def _first_bad_byte(text: str) -> str:
    """"byte 0xff at character 9" for a surrogate-escaped name."""
    for index, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            return f"byte 0x{ord(ch) - 0xdc00:02x} at character {index + 1}"
    return "a character UTF-8 cannot encode"
