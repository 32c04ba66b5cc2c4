"""Safe output paths: checked against every input before any work, written to a temporary name,
moved into place, and never left half-written (errors and SIGINT/SIGTERM/SIGHUP alike)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from attnviz.errors import Interrupted, OutputError, UsageError, from_os_error, printable_path

# Bounds the listing of a folder being read: a model folder holds tens of files, not millions.
MAX_FOLDER_ENTRIES = 100_000


@dataclass(frozen=True)
class ReadSet:
    """Everything a run reads: files by resolved path and by (device, inode), so symlinks, `..`
    and hard links to an input are all caught, and the model folders themselves."""

    paths: frozenset[Path] = frozenset()
    inodes: frozenset[tuple[int, int]] = frozenset()
    folders: frozenset[Path] = frozenset()

    def holds(self, path: Path) -> str | None:
        """Why writing to resolved `path` would touch an input, or None."""
        if path in self.paths:
            return "the output path is an input file"
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in self.inodes:
                return "the output path is an input file (a link to it)"
        if path.parent in self.folders:
            return "the output path is inside a model folder being read"
        return None


def read_set(files: Iterable[Path] = (), folders: Iterable[Path] = ()) -> ReadSet:
    """The ReadSet of some input files and model folders (every regular file in each folder)."""
    paths: set[Path] = set()
    inodes: set[tuple[int, int]] = set()
    folder_set: set[Path] = set()

    def add(path: Path) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # a missing input fails later, clearly
            resolved = path.expanduser().resolve()
            st = os.stat(resolved)
            paths.add(resolved)
            inodes.add((st.st_dev, st.st_ino))

    for file in files:
        add(file)
    for folder in folders:
        try:
            resolved = folder.expanduser().resolve()
        except (OSError, RuntimeError):
            continue
        folder_set.add(resolved)
        with contextlib.suppress(OSError):
            with os.scandir(resolved) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_FOLDER_ENTRIES:
                        break
                    add(Path(entry.path))
    return ReadSet(frozenset(paths), frozenset(inodes), frozenset(folder_set))


def check_output_path(path: Path, suffixes: Iterable[str], inputs: ReadSet = ReadSet(),
                      option: str = "out") -> Path:
    """Resolve an output path and refuse ones that cannot be written safely."""
    allowed = tuple(suffixes)
    shown = printable_path(path)
    if path.suffix.lower() not in allowed:
        raise UsageError(f"cannot tell the output format from {shown!r}",
                         fix=f"end the file name with {', '.join(allowed)}", option=option)
    try:
        resolved = path.expanduser().resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise OutputError("the output path cannot be resolved (a symlink loop?)",
                          fix="choose another name", where=shown) from None
    if resolved.is_dir():
        raise OutputError("the output path is a folder", fix="name a file inside it", where=shown)
    if not resolved.parent.is_dir():
        raise OutputError("the output folder does not exist", fix="create it first", where=shown)
    reason = inputs.holds(resolved)
    if reason is not None:
        raise OutputError(reason,
                          fix="write it somewhere else: attnviz never overwrites its inputs",
                          where=shown)
    if resolved.exists() and not stat.S_ISREG(resolved.stat().st_mode):
        raise OutputError("the output path exists and is not a regular file", where=shown)
    return resolved


def check_distinct(*paths: Path | None) -> None:
    """Two outputs of one run must not name the same file."""
    chosen = [p for p in paths if p is not None]
    if len(set(chosen)) != len(chosen):
        raise UsageError("two outputs name the same file", fix="choose a different name for each")


_CAUGHT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                        if hasattr(signal, name))


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While writing, SIGTERM and SIGHUP raise Interrupted (as SIGINT raises KeyboardInterrupt),
    so the cleanup below runs instead of the process dying with a temporary file left behind."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {}
    try:
        for sig in _CAUGHT_SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals cannot be caught here
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on failure it goes."""
    with _signals_raise():
        # the temporary name stays short whatever the output's (a legal 255-byte name plus
        # mkstemp's additions would pass the file system's limit)
        stem = os.fsencode(path.name)[:64].decode("utf-8", "ignore")
        suffix = path.suffix if len(os.fsencode(path.suffix)) <= 16 else ""
        fd, tmp_name = tempfile.mkstemp(prefix=f".{stem}.", suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            yield _writable_by_libraries(tmp)
            os.chmod(tmp, _new_file_mode(path))  # mkstemp makes 0600; give the usual permissions
            os.replace(tmp, path)
        except OSError as exc:  # a full disk (ENOSPC), a size limit (EFBIG), a read-only disk
            tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot write the output: {exc.strerror or type(exc).__name__}",
                              fix=from_os_error(exc).fix, where=printable_path(path)) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _writable_by_libraries(tmp: Path) -> Path:
    """The temporary file by a name every writer accepts: the safetensors writer (Rust) cannot
    take a folder name that is not UTF-8 (`caf\\xe9/`), so such a folder is reached through an
    ASCII-named link (`load.paths.library_path`); the file itself is the same."""
    try:
        str(tmp).encode("utf-8")
        return tmp
    except UnicodeEncodeError:
        from attnviz.load.paths import library_path

        return library_path(tmp.parent) / tmp.name


def write_output(path: Path, write: Callable[[Path], object]) -> None:
    """The one way a run writes a file: `write` fills a temporary file beside `path`, which
    replaces `path` only when it succeeded (render draws, this writes)."""
    with atomic_output(path) as tmp:
        write(tmp)


def check_free_space(path: Path, needed: int) -> None:
    """Refuse, before writing, an output the device has no room for."""
    import shutil

    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return  # the write itself will say
    if needed > free:
        raise OutputError(f"the output needs {needed / 1e6:.1f} MB but its device has "
                          f"{free / 1e6:.1f} MB free",
                          fix="free some space, or write somewhere else",
                          where=printable_path(path))


def _new_file_mode(path: Path) -> int:
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
