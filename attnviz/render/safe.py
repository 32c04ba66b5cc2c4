"""The one way text reaches the terminal.

Every string attnviz shows may come from a file (tensor names, config values, tokenizer tokens,
paths) or from the user (sentences, --file lines, option values). Renderers build `Text` from
them with `safe_text`, which escapes what `attnviz.errors.printable` escapes; the console from
`console()` never interprets rich markup (`[bold]`, `[/]`) or emoji codes in plain strings, and, as
a last line of defence, escapes any non-printable character still left in a rendered segment.
Styles (colours) are rich's own escape sequences, added after that check.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import sys
from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING

from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from attnviz.errors import UsageError, printable

if TYPE_CHECKING:
    from rich.console import ConsoleOptions, RenderableType

MIN_COLUMNS = 8  # narrower than this, no table or map can be drawn
MAX_COLUMNS = 10_000  # wider than any terminal; lines are built to this width
FALLBACK_COLUMNS = 80  # for an unusable COLUMNS


def safe_text(text: object, style: str = "") -> Text:
    """A rich Text of any string, escaped: no markup, no control character."""
    return Text(printable(str(text), None), style=style)


def _escape_segment(text: str) -> str:
    return "\n".join(printable(part, None) for part in text.split("\n"))


class SafeConsole(Console):
    """A Console that shows strings literally and never writes a control character of its own
    text: markup, emoji codes and highlighting are off, and segments are escaped as they are
    rendered (a missed `safe_text` cannot reach the terminal)."""

    _checking = False  # renderables render their parts through this method too: check once

    def on_broken_pipe(self) -> None:
        """`attnviz … | head`: the reader took what it wanted and closed the pipe. That is a
        success (exit 0, nothing on stderr), not rich's default exit 1."""
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0)

    if not hasattr(Console, "on_broken_pipe"):
        # rich < 13.8 has no on_broken_pipe hook: its BrokenPipeError reaches typer, which exits
        # 1. The same hook, called where rich >= 13.8 calls it.
        def _check_buffer(self) -> None:
            try:
                super()._check_buffer()
            except BrokenPipeError:
                self.on_broken_pipe()

    def render(self, renderable: RenderableType,
               options: ConsoleOptions | None = None) -> Iterable[Segment]:
        if self._checking:
            yield from super().render(renderable, options)
            return
        self._checking = True
        try:
            for segment in super().render(renderable, options):
                text = segment.text
                if segment.control is None and text != "\n" and not text.isprintable():
                    segment = Segment(_escape_segment(text), segment.style, segment.control)
                yield segment
        finally:
            self._checking = False


def check_terminal_size(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """COLUMNS and LINES, when set to digits, must be usable: rich trusts them (COLUMNS=0 leaves
    no room for any output, and digits Python cannot convert make rich itself fail). An unusable
    value is replaced (COLUMNS by 80, LINES dropped) and a note returned for each."""
    values: MutableMapping[str, str] = os.environ if environ is None else environ
    notes = []
    for name, low in (("COLUMNS", MIN_COLUMNS), ("LINES", 1)):
        value = values.get(name)
        if value is None or not value.isdigit():
            continue  # unset or not a number: rich ignores it too
        if not (value.isascii() and len(value) <= 6 and low <= int(value) <= MAX_COLUMNS):
            if name == "COLUMNS":
                values[name] = str(FALLBACK_COLUMNS)
            else:
                del values[name]
            using = f"using {FALLBACK_COLUMNS} columns" if name == "COLUMNS" else "ignoring it"
            notes.append(f"{name}={printable(value, 20)} is not a usable terminal size; {using} "
                         f"(set it to a number from {low} to {MAX_COLUMNS})")
    return notes


def console(stderr: bool = False) -> SafeConsole:
    return SafeConsole(stderr=stderr, highlight=False, soft_wrap=False, markup=False, emoji=False)


def prepare_streams() -> list[str]:
    """Standard streams every environment can give: a closed descriptor 0, 1 or 2 (a daemon,
    cron, `cmd >&-`) is filled with /dev/null before anything opens a file (which would
    otherwise take its number, and receive the error lines), and its Python stream rebuilt.
    stderr never fails on a character its encoding lacks (an error line must always get out).
    stdout stays strict, unless its encoding is the locale's own (LANG=C without Python's UTF-8
    mode): then what it cannot show is drawn in ASCII. Returns notes for stderr, and records
    whether stdout was closed (`stdout_closed`)."""
    notes = []
    _STATE["stdout_closed"] = False
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            closed = getattr(sys, name) is None
        except OSError:
            closed = True
            with contextlib.suppress(OSError):
                if os.open(os.devnull, os.O_RDWR) != fd:  # the lowest free number: fd
                    continue
        if closed:
            with contextlib.suppress(OSError, ValueError):
                setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115
            if fd == 1:
                _STATE["stdout_closed"] = True
    reconfigure = getattr(sys.stderr, "reconfigure", None)
    if reconfigure is not None:
        with contextlib.suppress(ValueError, OSError):
            reconfigure(errors="backslashreplace")
    if _ascii_locale():
        with contextlib.suppress(ValueError, OSError, AttributeError):
            sys.stdout.reconfigure(errors=ASCII_FALLBACK)  # type: ignore[union-attr]
            notes.append(f"stdout's encoding {printable(sys.stdout.encoding, 20)} (the locale's) "
                         "lacks the drawing characters; drawing in ASCII (LANG=C.UTF-8 shows "
                         "them)")
    return notes


_STATE = {"stdout_closed": False}


def stdout_closed() -> bool:
    """Whether file descriptor 1 was closed when attnviz started (its output went nowhere)."""
    return _STATE["stdout_closed"]


# what the drawing characters become on an ASCII stdout
_ASCII = {**dict.fromkeys("─━═╌┄", "-"), **dict.fromkeys("│┃║╎┆", "|"),
          **dict.fromkeys("┌┏┐┓└┗┘┛├┣┤┫┬┳┴┻┼╋╇╈╪╫┡┩┢┪╀╁╂┿╃╄╅╆", "+"),
          "█": "#", "▓": "%", "▒": "+", "░": ".", "·": "*", "×": "x", "✓": "ok", "✗": "X",
          "…": "...", "—": "--", "–": "-", "≤": "<=", "≥": ">=", "≈": "~", "→": "->",
          "←": "<-", "Δ": "d", "ᵀ": "^T", "√": "sqrt", "•": "*", "‖": "||", "±": "+/-",
          "²": "^2", "⁻": "^-", "¹": "^1"}
ASCII_FALLBACK = "attnviz-ascii"


def _ascii_fallback(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    text = exc.object[exc.start:exc.end]
    return "".join(_ASCII.get(ch) or ascii(ch)[1:-1] for ch in text), exc.end


codecs.register_error(ASCII_FALLBACK, _ascii_fallback)


def _ascii_locale() -> bool:
    """stdout cannot show attnviz's drawing characters, and its encoding comes from the locale
    (not from PYTHONIOENCODING or a caller's stream): the environment's limit, not a request."""
    import locale

    encoding = getattr(sys.stdout, "encoding", None)
    if not encoding or os.environ.get("PYTHONIOENCODING"):
        return False
    try:
        "─█✓·".encode(encoding)
        return False
    except UnicodeEncodeError:
        pass
    except LookupError:
        return False
    try:
        preferred = locale.getpreferredencoding(False)
        return codecs.lookup(preferred).name == codecs.lookup(encoding).name
    except LookupError:
        return False


def stdout_problem(exc: BaseException) -> UsageError | None:
    """The error for output stdout's encoding cannot carry (PYTHONIOENCODING=ascii, a legacy
    locale), or None when `exc` is something else."""
    if not isinstance(exc, UnicodeEncodeError):
        return None
    encoding = getattr(sys.stdout, "encoding", None) or ""
    try:
        same = codecs.lookup(encoding).name == codecs.lookup(exc.encoding).name
    except LookupError:
        same = False
    if not same:
        return None
    char = exc.object[exc.start : exc.start + 1] if isinstance(exc.object, str) else "?"
    return UsageError(f"stdout's encoding {printable(encoding, 20)} cannot show "
                      f"{printable(ascii(char), 12)}, which attnviz's tables and maps use",
                      fix="set PYTHONIOENCODING=utf-8 or a UTF-8 locale (LANG=C.UTF-8), or pass "
                      "--json (ASCII-only output)", where="stdout")
