"""Token ids named by the model's tokenizer, including ids it has no token for.

A model's embedding often has more rows than its tokenizer has tokens: Qwen2 has 151,936 rows
for 151,665 tokens, and many models pad the table to a multiple of 64 or 128. The language-model
head scores those rows too, so greedy decoding or sampling can write such an id. The tokenizer
then gives no token (`convert_ids_to_tokens` returns None; a sentencepiece tokenizer raises), and
`decode` skips the id without a trace. attnviz names such an id `<id N>` wherever a token would
appear (the terminal, JSON, the HTML page, --export, figures), and puts the same `<id N>` into the
decoded text. Such a name is not a special token for the statistics: the model wrote an ordinary
(if untrained) row of its vocabulary.
"""

from __future__ import annotations

from typing import Any

from attnviz.sources.generate_spec import unnamed


def token_names(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id's token as the tokenizer names it, `<id N>` where it names none."""
    return [unnamed(i) if name is None else name
            for i, name in zip(ids, _names(tokenizer, ids), strict=True)]


def decoded_text(tokenizer: Any, ids: list[int]) -> str:
    """The ids decoded (special tokens skipped), each id the tokenizer cannot name shown as
    `<id N>` where it was written instead of being dropped: runs of named ids are decoded by the
    tokenizer, and a space separates a `<id N>` from words on either side."""
    pieces: list[str] = []
    run: list[int] = []
    for token_id, name in zip(ids, _names(tokenizer, ids), strict=True):
        if name is not None:
            run.append(token_id)
            continue
        if run:
            pieces.append(str(tokenizer.decode(run, skip_special_tokens=True)))
            run = []
        pieces.append(unnamed(token_id))
    if run:
        pieces.append(str(tokenizer.decode(run, skip_special_tokens=True)))
    text = ""
    for piece in pieces:
        if text and piece and not text[-1].isspace() and not piece[0].isspace():
            text += " "
        text += piece
    return text


def _names(tokenizer: Any, ids: list[int]) -> list[str | None]:
    """The tokenizer's token per id, None where it has none."""
    ids = [int(i) for i in ids]
    try:
        names = list(tokenizer.convert_ids_to_tokens(ids))
    except (IndexError, KeyError, ValueError, TypeError, OverflowError):
        names = []  # a sentencepiece tokenizer raises on an id past its vocabulary
    if len(names) != len(ids):
        names = [_one(tokenizer, i) for i in ids]
    return [name if isinstance(name, str) else None for name in names]


def _one(tokenizer: Any, token_id: int) -> str | None:
    try:
        name = tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, KeyError, ValueError, TypeError, OverflowError):
        return None
    return name if isinstance(name, str) else None
