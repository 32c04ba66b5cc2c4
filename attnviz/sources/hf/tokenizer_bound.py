"""How long a fast tokenizer's normalizers and pre-tokenizers can make a text, read from its
own description (`backend_tokenizer.to_str()`, the tokenizer.json it was built from) before
any text reaches Rust.

A 1.9 KB tokenizer.json whose normalizer is a Sequence of 30 `Replace("a" → "aa")` steps
turns one letter into 10⁹ characters inside the Rust library, before any token limit, and the
process dies in the allocator. Each step has a known worst-case growth (a Replace: its
content's length over its pattern's; NFKC: 18 characters per character; a precompiled
sentencepiece map: its longest replacement), so a text of n characters has a bound the whole
chain cannot pass. A post-processor template that repeats the text (`$A $A $A …`) multiplies
its tokens the same way and joins the chain. A text whose bound passes `MAX_NORMALIZED_CHARS`
is refused, naming the step that grows it most. The decoder (ids back to text, when generated
text is shown) may not grow a text more than MAX_DECODER_GROWTH-fold. Whatever still goes wrong
inside Rust is reported by the command line's supervisor (cli/supervisor.py) in one line.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnviz.errors import CheckpointError, printable

MAX_NORMALIZED_CHARS = 4_000_000  # characters one text may become before tokens are cut
MAX_WORDPIECE_WORD = 1000  # longer words are matched in time cubic in their length
MAX_DECODER_GROWTH = 64  # a decoder may turn one character into at most this many
MAX_DESCRIPTION_BYTES = 64 * 1024 * 1024  # a tokenizer description longer than this is not read

# worst-case characters out per character in, for steps that grow text by a fixed factor
_FACTORS = {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 2, "ByteLevel": 4,
            "BertNormalizer": 24, "BertPreTokenizer": 1, "Strip": 1, "StripAccents": 1,
            "Nmt": 1, "Whitespace": 1, "WhitespaceSplit": 1, "Punctuation": 1, "Digits": 1,
            "Split": 1, "UnicodeScripts": 1, "CharDelimiterSplit": 1, "FixedLength": 1}


@dataclass(frozen=True)
class Step:
    """One normalizer or pre-tokenizer: n characters in → at most `grow(n)` out."""

    name: str
    grow: Callable[[int], int]
    longest: int | None = None  # a longer text is refused: this step's time is superlinear


def _wordpiece(model: object) -> list[Step]:
    """WordPiece matches each word greedily, longest piece first: time grows with the cube of a
    word's length, and words past `max_input_chars_per_word` become [UNK] at once. A model's
    own limit (BERT's 100) keeps that small; a huge one makes a long word hang the process."""
    if not isinstance(model, dict) or model.get("type") != "WordPiece":
        return []
    limit = model.get("max_input_chars_per_word")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= MAX_WORDPIECE_WORD:
        return []
    return [Step(f"model WordPiece (max_input_chars_per_word {limit})", _linear(1),
                 MAX_WORDPIECE_WORD)]


def _linear(factor: int, add: int = 0) -> Callable[[int], int]:
    return lambda n: n * factor + add


def _replace(node: dict[str, Any]) -> Callable[[int], int]:
    pattern = node.get("pattern")
    content = node.get("content")
    grown = len(content) if isinstance(content, str) else 0
    if isinstance(pattern, dict) and isinstance(pattern.get("String"), str) \
            and pattern["String"]:
        width = len(pattern["String"])
        return lambda n: n if grown <= width else n * -(-grown // width)
    # a regex may match the empty string: the content could land between every two characters
    return lambda n: n + (n + 1) * grown


def _precompiled(node: dict[str, Any]) -> Callable[[int], int]:
    """A sentencepiece charsmap: a trie, then NUL-terminated replacements; the longest one
    bounds what one matched character becomes."""
    try:
        blob = base64.b64decode(node.get("precompiled_charsmap") or "", validate=False)
        (trie_size,) = struct.unpack_from("<I", blob)
        strings = blob[4 + trie_size:].split(b"\0")
        longest = max((len(s.decode("utf-8", "replace")) for s in strings), default=1)
    except (ValueError, struct.error, TypeError):
        longest = 18  # unreadable: the NFKC bound, which such maps usually implement
    factor = max(1, longest)
    return _linear(factor)


def _template(node: dict[str, Any]) -> Callable[[int], int]:
    """A post-processor template: each `Sequence` piece repeats the text's tokens, each special
    token adds its ids (a text's tokens are counted as its characters, which they do not
    outnumber but for byte fallback's few per character)."""
    single = node.get("single")
    pieces = single if isinstance(single, list) else []
    specials = node.get("special_tokens")
    specials = specials if isinstance(specials, dict) else {}
    copies, added = 0, 0
    for piece in pieces:
        if isinstance(piece, dict) and "Sequence" in piece:
            copies += 1
        elif isinstance(piece, dict) and isinstance(piece.get("SpecialToken"), dict):
            token = specials.get(piece["SpecialToken"].get("id"))
            ids = token.get("ids") if isinstance(token, dict) else None
            added += len(ids) if isinstance(ids, list) else 1
    return lambda n: n * max(copies, 1) + added


def steps_of(node: object, path: str = "normalizer", depth: int = 0) -> list[Step]:
    """The steps of a normalizer or pre-tokenizer description, in order (Sequences flattened)."""
    if not isinstance(node, dict) or depth > 32:
        return []
    kind = node.get("type")
    if kind == "Sequence":
        children: object = next((node[key] for key in ("normalizers", "pretokenizers", "processors",
                                                "decoders") if key in node), [])
        found: list[Step] = []
        for i, child in enumerate(children if isinstance(children, list) else []):
            found += steps_of(child, f"{path}[{i}]", depth + 1)
        return found
    name = f"{path} {printable(str(kind), 40)}"
    if kind == "Replace":
        return [Step(name, _replace(node))]
    if kind == "Prepend":
        prefix = node.get("prepend")
        return [Step(name, _linear(1, len(prefix) if isinstance(prefix, str) else 0))]
    if kind == "Metaspace":
        return [Step(name, _linear(1, 1))]
    if kind == "Precompiled":
        return [Step(name, _precompiled(node))]
    if kind == "TemplateProcessing":
        return [Step(name, _template(node))]
    return [Step(name, _linear(_FACTORS.get(str(kind), 1)))]


def chain_of(tokenizer: Any) -> list[Step] | None:
    """The normalizer and pre-tokenizer steps of a fast tokenizer (None: not a fast one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    text = backend.to_str()
    if len(text) > MAX_DESCRIPTION_BYTES:
        raise CheckpointError(f"the tokenizer's description is {len(text)} bytes long",
                              fix="check its tokenizer.json")
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise CheckpointError("the tokenizer's description is not a JSON object",
                              fix="check its tokenizer.json")
    _check_decoder(steps_of(spec.get("decoder"), "decoder"))
    return (steps_of(spec.get("normalizer"), "normalizer")
            + steps_of(spec.get("pre_tokenizer"), "pre_tokenizer")
            + steps_of(spec.get("post_processor"), "post_processor")
            + _wordpiece(spec.get("model")))


def _check_decoder(steps: list[Step]) -> None:
    """A decoder (ids back to text, as generation shows it) may not multiply text: a model's own
    decoders replace a marker by a space or join byte pieces, none grows a text
    MAX_DECODER_GROWTH-fold."""
    size, worst, worst_growth = 1, None, 1.0
    for step in steps:
        grown = step.grow(size)
        if grown / size > worst_growth:
            worst, worst_growth = step, grown / size
        size = max(1, grown)
        if size > MAX_DECODER_GROWTH:
            break
    if size > MAX_DECODER_GROWTH and worst is not None:
        raise CheckpointError(
            f"the model's tokenizer decoder could grow a text more than "
            f"{MAX_DECODER_GROWTH}-fold; {worst.name} alone grows it {worst_growth:,.0f}×",
            fix="check the decoder of its tokenizer.json (a model's own decoder does not "
            "multiply text)")


def check_text_bound(steps: list[Step] | None, length: int, what: str, where: str) -> None:
    """Refuse a text the tokenizer's steps could grow past MAX_NORMALIZED_CHARS."""
    if not steps:
        return
    for step in steps:
        if step.longest is not None and length > step.longest:
            raise CheckpointError(
                f"{what} has {length} characters, and the model's tokenizer's {step.name} "
                f"takes time cubic in a word's length past {step.longest} characters",
                fix="set max_input_chars_per_word to 100 (BERT's value) in its tokenizer.json, "
                f"or pass a text of at most {step.longest} characters", where=where)
    size, worst, worst_growth = length, None, 1.0
    for step in steps:
        grown = step.grow(size)
        if size and grown / size > worst_growth:
            worst, worst_growth = step, grown / size
        size = grown
        if size > MAX_NORMALIZED_CHARS:
            break
    if size > MAX_NORMALIZED_CHARS:
        named = f"; {worst.name} alone grows it {worst_growth:,.0f}×" if worst else ""
        raise CheckpointError(
            f"the model's tokenizer could grow {what} ({length} characters) past "
            f"{MAX_NORMALIZED_CHARS:,} characters before any token limit applies{named}",
            fix="check that step of its tokenizer.json (a model's own tokenizer does not "
            "multiply text), or pass a shorter text", where=where)
