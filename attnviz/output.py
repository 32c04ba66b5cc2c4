"""Safe output paths: checked before any work, written to a temporary name, moved into place."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from attnviz.errors import OutputError, UsageError, printable


def check_output_path(path: Path, suffixes: Iterable[str], inputs: Iterable[Path] = (),
                      option: str = "--out") -> Path:
    """Resolve an output path and refuse ones that cannot be written safely."""
    allowed = tuple(suffixes)
    shown = printable(str(path))
    if path.suffix.lower() not in allowed:
        raise UsageError(f"cannot tell the output format from {shown!r}",
                         f"end the file name with {', '.join(allowed)}", option)
    resolved = path.expanduser().resolve()
    if resolved.is_dir():
        raise OutputError("the output path is a folder", "name a file inside it", shown)
    if not resolved.parent.is_dir():
        raise OutputError("the output folder does not exist", "create it first", shown)
    for source in inputs:
        if source.exists() and resolved == source.resolve():
            raise OutputError("the output path is an input file", "choose another name", shown)
    if resolved.exists() and not resolved.is_file():
        raise OutputError("the output path exists and is not a regular file", "", shown)
    return resolved


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on failure it goes."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, _new_file_mode(path))  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the output: {exc.strerror}", "",
                          printable(str(path))) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _new_file_mode(path: Path) -> int:
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
