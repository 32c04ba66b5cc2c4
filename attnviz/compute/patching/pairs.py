"""Prompt pairs for activation patching: a clean prompt, its corrupted twin, the answer the clean
prompt should produce and, for the logit difference, a wrong answer (the corrupted prompt's).

A pair comes from the command line or from a file of many: TSV (clean, corrupt, answer[, wrong];
a first line `clean<TAB>corrupt<TAB>answer…` is a header) or JSON lines
(`{"clean": …, "corrupt": …, "answer": …, "wrong": …}`). Tokenized by the model's own tokenizer
(a `Tokenizer`), the two prompts of a pair must have the same number of tokens, so that
position i of one run is position i of the other; the error shows both tokenizations.

Nothing here imports torch: the API and other commands (the logit lens, direct logit
attribution) read pairs with the same rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from attnviz.core.choices import PatchMetric
from attnviz.errors import UsageError, option, printable, printable_path, quoted

MAX_PAIRS = 4096  # pairs read from one file at most
MAX_LINE_BYTES = 1 << 16
FIELDS = ("clean", "corrupt", "answer", "wrong")
PAIRS_FIX = (f"{option('pairs')} takes one pair a line: TSV "
             "'clean<TAB>corrupt<TAB>answer[<TAB>wrong]', or JSON lines "
             '{"clean": …, "corrupt": …, "answer": …, "wrong": …}')


@dataclass(frozen=True)
class PromptPair:
    """One clean/corrupted prompt pair, as text."""

    clean: str
    corrupt: str
    answer: str  # the clean prompt's answer (with --metric loss: the continuation scored)
    wrong: str | None = None  # the other answer of the logit difference (the corrupted one's)


class Tokenizer(Protocol):
    """A model's tokenizer, as patching needs it."""

    def prompt(self, text: str) -> tuple[list[int], list[str]]:
        """(ids, token names) of a prompt, with the special tokens the model expects."""
        ...

    def piece(self, text: str) -> tuple[list[int], list[str]]:
        """(ids, token names) of an answer or continuation: no special tokens added."""
        ...


@dataclass(frozen=True)
class TokenizedPair:
    """A pair in token ids: clean and corrupt have the same length; `answer` is one id (or,
    for the loss, the continuation's ids, appended to both prompts)."""

    pair: PromptPair
    clean: list[int]
    corrupt: list[int]
    clean_names: list[str]
    corrupt_names: list[str]
    answer: list[int]
    answer_names: list[str]
    wrong: int | None
    wrong_name: str | None

    @property
    def prompt_length(self) -> int:
        return len(self.clean)


def pair_from_options(clean: str, corrupt: str | None, answer: str | None,
                      wrong: str | None) -> PromptPair:
    """The pair given on the command line (or as API keywords)."""
    if corrupt is None:
        raise UsageError("a clean prompt needs its corrupted twin",
                         fix=f"add {option('corrupt')} TEXT (as many tokens as the clean one)",
                         option="corrupt")
    if answer is None:
        raise UsageError("the metric needs the clean prompt's answer",
                         fix=f"add {option('answer')} TOKEN", option="answer")
    return PromptPair(clean, corrupt, answer, wrong)


def parse_pairs(lines: Iterable[str], where: str) -> list[PromptPair]:
    """Pairs from the lines of a TSV or JSON-lines text (blank lines skipped)."""
    pairs: list[PromptPair] = []
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        if len(pairs) >= MAX_PAIRS:
            raise UsageError(f"the pair file holds more than {MAX_PAIRS} pairs",
                             fix="split it into smaller files", where=where)
        if line.lstrip().startswith("{"):
            pairs.append(_json_pair(line, number, where))
            continue
        cells = line.split("\t")
        if not pairs and [c.strip().lower() for c in cells[:3]] == list(FIELDS[:3]):
            continue  # a header row
        if len(cells) not in (3, 4):
            raise UsageError(f"line {number} has {len(cells)} tab-separated fields, not 3 or 4",
                             fix=PAIRS_FIX, where=where)
        clean, corrupt, answer = cells[:3]
        wrong = cells[3] if len(cells) == 4 and cells[3] != "" else None
        pairs.append(_checked(PromptPair(clean, corrupt, answer, wrong), number, where))
    if not pairs:
        raise UsageError("the pair file holds no pair", fix=PAIRS_FIX, where=where)
    return pairs


def _json_pair(line: str, number: int, where: str) -> PromptPair:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"line {number} is not valid JSON ({exc.msg})", fix=PAIRS_FIX,
                         where=where) from None
    if not isinstance(record, dict):
        raise UsageError(f"line {number} is not a JSON object", fix=PAIRS_FIX, where=where)
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise UsageError(f"line {number} has an unknown field {quoted(str(unknown[0]))}",
                         fix=f"use {', '.join(FIELDS)}", where=where)
    for name in FIELDS[:3]:
        if not isinstance(record.get(name), str):
            raise UsageError(f"line {number} lacks a text {name!r}", fix=PAIRS_FIX, where=where)
    wrong = record.get("wrong")
    if wrong is not None and not isinstance(wrong, str):
        raise UsageError(f"line {number}: 'wrong' must be text", fix=PAIRS_FIX, where=where)
    return _checked(PromptPair(record["clean"], record["corrupt"], record["answer"], wrong),
                    number, where)


def _checked(pair: PromptPair, number: int, where: str) -> PromptPair:
    for name in FIELDS[:3]:
        if not getattr(pair, name).strip():
            raise UsageError(f"line {number}: {name!r} is empty", fix=PAIRS_FIX, where=where)
    return pair


def read_pairs(path: Path) -> list[PromptPair]:
    """Pairs from a TSV or JSON-lines file (UTF-8), a line at a time: each line at most 64 KiB,
    the file at most MAX_PAIRS lines of pairs (`/dev/zero` stops at its first line; a FIFO
    without a writer reads as empty instead of blocking)."""
    import os
    import stat

    where = printable_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"cannot read the pair file: {exc.strerror}", fix=PAIRS_FIX,
                         where=where) from None
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError("the pair file is a folder", fix=PAIRS_FIX, where=where)
    os.set_blocking(fd, True)
    lines: list[str] = []
    with os.fdopen(fd, "rb") as f:
        while len(lines) <= 2 * MAX_PAIRS:  # blank lines and a header count too
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            if len(raw) > MAX_LINE_BYTES:
                raise UsageError(f"line {len(lines) + 1} is longer than {MAX_LINE_BYTES} bytes",
                                 fix=PAIRS_FIX, where=where)
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise UsageError(f"line {len(lines) + 1} is not UTF-8 text", fix=PAIRS_FIX,
                                 where=where) from None
    return parse_pairs(lines, where)


def tokenize_pair(pair: PromptPair, tokenizer: Tokenizer, metric: PatchMetric,
                  number: int = 1) -> TokenizedPair:
    """`pair` in the model's tokens, checked: equal lengths, a one-token answer (and wrong
    answer) unless the metric is the loss, a wrong answer exactly for the logit difference."""
    clean, clean_names = tokenizer.prompt(pair.clean)
    corrupt, corrupt_names = tokenizer.prompt(pair.corrupt)
    label = f"pair {number}"
    if not clean:
        raise UsageError(f"{label}: the clean prompt has no tokens", fix="give a prompt")
    if len(clean) != len(corrupt):
        raise UsageError(
            f"{label}: the clean prompt is {len(clean)} tokens {_shown(clean_names)}, the "
            f"corrupted one {len(corrupt)} {_shown(corrupt_names)}",
            fix="make them tokenize to the same length, so that each position of one is the "
            "same position of the other", option="corrupt")
    answer, answer_names = tokenizer.piece(pair.answer)
    if not answer:
        raise UsageError(f"{label}: the answer {quoted(pair.answer)} has no tokens",
                         fix=f"give a non-empty {option('answer')}", option="answer")
    wrong = wrong_name = None
    if metric is PatchMetric.LOSS:
        if pair.wrong is not None:
            raise UsageError(f"{label}: {option('wrong')} does not apply to the loss metric",
                             fix=f"drop it, or use {option('metric')} logit-diff",
                             option="wrong")
        return TokenizedPair(pair, clean, corrupt, clean_names, corrupt_names, answer,
                             answer_names, None, None)
    _one_token(answer, answer_names, pair.answer, label, "answer")
    if metric is PatchMetric.LOGIT_DIFF:
        if pair.wrong is None:
            raise UsageError(f"{label}: the logit difference needs a wrong answer",
                             fix=f"add {option('wrong')} TOKEN (the corrupted prompt's answer), "
                             f"or use {option('metric')} logprob", option="wrong")
        ids, names = tokenizer.piece(pair.wrong)
        _one_token(ids, names, pair.wrong, label, "wrong")
        wrong, wrong_name = ids[0], names[0]
        if wrong == answer[0]:
            raise UsageError(f"{label}: the answer and the wrong answer are the same token "
                             f"{quoted(names[0])}", fix="give two different tokens",
                             option="wrong")
    elif pair.wrong is not None:
        raise UsageError(f"{label}: {option('wrong')} applies only to the logit difference",
                         fix=f"drop it, or use {option('metric')} logit-diff", option="wrong")
    return TokenizedPair(pair, clean, corrupt, clean_names, corrupt_names, answer, answer_names,
                         wrong, wrong_name)


def _one_token(ids: list[int], names: list[str], text: str, label: str, name: str) -> None:
    if len(ids) != 1:
        raise UsageError(f"{label}: the {name} {quoted(text)} is {len(ids)} tokens "
                         f"{_shown(names)}, the metric scores one",
                         fix="give a single token (often with its leading space, ' Mary'), "
                         f"or use {option('metric')} loss for a continuation", option=name)


def _shown(names: list[str], limit: int = 24) -> str:
    """Token names as a bracketed list, each made printable; long lists elided."""
    shown = [printable(n, 24) for n in names[:limit]]
    more = f", … {len(names) - limit} more" if len(names) > limit else ""
    return "[" + ", ".join(repr(s) for s in shown) + more + "]"
