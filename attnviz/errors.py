"""attnviz's error hierarchy. Lower layers raise these; only the CLI turns them into exit codes."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    DATA = 1  # bad data, a failed check, an output that cannot be written
    USAGE = 2  # command-line misuse


class AttnvizError(Exception):
    """A failure the user can fix.

    `what` states the fact (what is wrong), `fix` how to fix it, `where` the file or object it
    concerns, `option` the command-line option it concerns (when the library knows one).
    """

    exit_code: ExitCode = ExitCode.DATA

    def __init__(self, what: str, *, fix: str = "", where: str = "", option: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix
        self.where = where
        self.option = option

    def one_line(self) -> str:
        text = self.what
        context = "; ".join(part for part in (self.option, self.where) if part)
        if context:
            text += f" ({context})"
        if self.fix:
            text += f" — {self.fix}"
        # One line, always: library texts and file names may carry newlines.
        return " ".join(text.split())


class UsageError(AttnvizError):
    """Arguments that cannot work together or are out of range."""

    exit_code = ExitCode.USAGE


class CheckpointError(AttnvizError):
    """A checkpoint that cannot be read, or whose contents contradict themselves."""


class LayoutError(CheckpointError):
    """Tensors or config that do not fit the attention layout they claim."""


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


def printable(text: str, limit: int = 80) -> str:
    """Escape control characters and shorten: names from files may be hostile."""
    escaped = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    if len(escaped) > limit:
        escaped = escaped[: limit - 1] + "…"
    return escaped
