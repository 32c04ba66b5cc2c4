"""--file: sentences read from a text file or standard input, one per line, within the limits
(a line at a time, so a file that passes one is refused as soon as it does)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attnviz.compute.forward_pass.inputs import TokenLimit, length_problem
from attnviz.core.request import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS
from attnviz.core.words import split_words
from attnviz.errors import AttnvizError, UsageError, option, printable_path


def max_line_bytes(max_tokens: int) -> int:
    """The longest --file line read: room for max_tokens words of 64 bytes, at least 64 KiB."""
    return max(1 << 16, 64 * max_tokens)


SENTENCE_FILE_FIX = "pass a UTF-8 text file, one sentence per line"


def read_sentences(path: Path, max_tokens: int = DEFAULT_MAX_TOKENS,
                   max_sentences: int = DEFAULT_MAX_SENTENCES, given: int = 0,
                   limit: TokenLimit | None = None) -> list[str]:
    """One sentence per non-blank line, read a line at a time and refused as soon as the file
    passes a limit (`given` sentences came from the command line; `limit` is the source's own
    bound on tokens, named with --max-tokens when a line passes both): `-f /dev/zero` stops
    after one over-long line, not at the end of memory."""
    where = "standard input" if str(path) == "-" else printable_path(path)
    sentences: list[str] = []
    with _open_sentence_file(path, where) as f:
        for line_number, text in _lines(f, max_line_bytes(max_tokens), where):
            sentences.append(text)
            number = given + len(sentences)
            if number > max_sentences:
                given_too = f" besides the {given} given" if given else ""
                raise UsageError(f"the sentence file holds more than {max_sentences - given} "
                                 f"sentences{given_too}: more than {option('max_sentences')} "
                                 f"{max_sentences}",
                                 fix=f"raise {option('max_sentences')} or pass fewer",
                                 where=where)
            problem = length_problem(f"sentence {number} (line {line_number})",
                                     len(split_words(text)), max_tokens, limit)
            if problem is not None:
                raise UsageError(problem[0], fix=problem[1], where=where)
    return sentences


def _open_sentence_file(path: Path, where: str) -> contextlib.AbstractContextManager[Any]:
    """The file as a binary stream. A FIFO without a writer reads as empty instead of
    blocking; a folder is an error. `-`: standard input, not closed afterwards."""
    if str(path) == "-":
        return contextlib.nullcontext(sys.stdin.buffer)
    try:
        # O_NONBLOCK: opening a FIFO that has no writer must not wait for one.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"cannot read the sentence file: {exc.strerror}",
                         fix=SENTENCE_FILE_FIX, where=where) from None
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError("the sentence file is a folder", fix=SENTENCE_FILE_FIX, where=where)
    os.set_blocking(fd, True)  # a FIFO with a writer is then read like a pipe
    return os.fdopen(fd, "rb")


def _lines(f: Any, limit: int, where: str) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of each non-blank line, each read within `limit` bytes;
    a longer line or invalid UTF-8 is an error naming the line."""
    line_number = 0
    while True:
        try:
            raw = f.readline(limit + 1)
        except OSError as exc:
            raise UsageError(f"cannot read the sentence file: {exc.strerror}",
                             fix=SENTENCE_FILE_FIX, where=where) from None
        if not raw:
            return
        line_number += 1
        if len(raw) > limit:
            raise UsageError(f"line {line_number} of the sentence file is longer than {limit} "
                             "bytes", fix=f"one sentence per line, or raise {option('max_tokens')}",
                             where=where)
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            # the file's content, not the command line: bad data (exit 1)
            raise AttnvizError(f"line {line_number} of the sentence file is not UTF-8 text (byte "
                             f"{exc.start + 1} of the line)", fix=SENTENCE_FILE_FIX,
                             where=where) from None
        if text:
            yield line_number, text
