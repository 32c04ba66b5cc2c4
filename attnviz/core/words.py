"""Word/punctuation tokenizer and hashed token ids, for standalone layers and the bundled model."""

from __future__ import annotations

import hashlib
import re

_TOKEN_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def split_words(sentence: str) -> list[str]:
    """Split a sentence into lower-cased words and single punctuation marks."""
    return [match.group(0).lower() for match in _TOKEN_RE.finditer(sentence)]


def token_hash(token: str) -> int:
    """A stable 64-bit hash of a token (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hashed_ids(tokens: list[str], vocab_size: int) -> list[int]:
    """Map tokens to ids in [0, vocab_size) by hashing: the same word always gets the same id."""
    return [token_hash(token) % vocab_size for token in tokens]
