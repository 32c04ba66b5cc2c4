"""Sentences → tokens → the vectors that enter an attention layer.

For a standalone layer, token i's input vector is, in order of preference:
1. the checkpoint's own embedding row, when the checkpoint has an embedding table of width E and a
   vocabulary file (vocab.txt, or tokenizer.json's model.vocab) in which the word is found;
2. otherwise a deterministic embedding derived from the token text: N(0, 1) numbers drawn from a
   generator seeded with the token's 64-bit BLAKE2b hash, so the same word always gets the same
   vector (duplicate words are visible) in every run and on every machine;
plus, with `positions="sinusoidal"`, the standard sinusoidal encoding of position i.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.core.choices import Positions
from attnviz.core.request import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS
from attnviz.core.words import split_words, token_hash
from attnviz.errors import UsageError, option, printable_path
from attnviz.load.jsonfile import parse_json
from attnviz.load.paths import read_capped
from attnviz.load.store import TensorStore

if TYPE_CHECKING:
    import torch

EMBEDDING_SUFFIXES = ("word_embeddings.weight", "embed_tokens.weight", "wte.weight",
                      "token_embedding.weight", "shared.weight", "embed_in.weight")
POSITION_SCHEMES = Positions.values()


@dataclass(frozen=True)
class Batch:
    sentences: list[str]
    tokens: list[list[str]]  # per sentence, unpadded

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def max_len(self) -> int:
        return max(self.lengths)


@dataclass(frozen=True)
class TokenLimit:
    """A bound on a sentence's tokens that the source itself sets, beside --max-tokens (the
    bundled model's learned positions): raising --max-tokens cannot lift it."""

    tokens: int
    holder: str  # who sets it, as a message names it: "the bundled model"


def length_problem(label: str, count: int, max_tokens: int | None,
                   limit: TokenLimit | None = None,
                   whom: str = "the sentence") -> tuple[str, str] | None:
    """(what, fix) for a sentence of `count` tokens that passes --max-tokens (None: not
    checked) or the source's own limit, naming every limit it passes, so that following the
    fix is enough (`whom` is what the fix shortens); None when it fits."""
    over_flag = max_tokens is not None and count > max_tokens
    over_source = limit is not None and count > limit.tokens
    flag = f"{option('max_tokens')} {max_tokens}"
    if limit is None or not over_source:
        if not over_flag:
            return None
        fix = f"raise {option('max_tokens')} or shorten {whom}" if limit is None else (
            f"raise {option('max_tokens')} (to at most {limit.tokens}: {limit.holder} knows "
            f"no more positions) or shorten {whom}")
        return (f"{label} has {count} tokens, more than {flag} (attention costs O(L²) per "
                "head)", fix)
    source = f"the {limit.tokens} positions {limit.holder} knows"
    both = f"{flag} and {source}" if over_flag else source
    fix = f"shorten {whom} to at most {limit.tokens} tokens" + (
        f" (raising {option('max_tokens')} cannot help)" if over_flag else "")
    return f"{label} has {count} tokens, more than {both}", fix


def make_batch(sentences: list[str], max_tokens: int = DEFAULT_MAX_TOKENS,
               max_sentences: int = DEFAULT_MAX_SENTENCES,
               limit: TokenLimit | None = None) -> Batch:
    """Tokenize and check every limit before anything is allocated: the sentence count, and
    each sentence's length against --max-tokens and the source's own `limit`, all passed
    limits named in one error."""
    if not sentences:
        raise UsageError("no sentence given",
                         fix=f"pass one or more sentences, or {option('file')} FILE")
    tokens = []
    for i, sentence in enumerate(sentences, 1):
        words = split_words(sentence)
        if not words:
            raise UsageError(f"sentence {i} is empty or has no words", fix="give it some text")
        tokens.append(words)
    problems = []
    if len(sentences) > max_sentences:
        problems.append((f"{len(sentences)} sentences exceed {option('max_sentences')} "
                         f"{max_sentences}",
                         f"raise {option('max_sentences')} or pass fewer"))
    over = [i for i, words in enumerate(tokens)
            if length_problem("", len(words), max_tokens, limit) is not None]
    if over:
        longest = max(over, key=lambda i: len(tokens[i]))
        more = len(over) - 1
        what, fix = length_problem(f"sentence {longest + 1}", len(tokens[longest]), max_tokens,
                                   limit, "each" if more else "the sentence") or ("", "")
        problems.append((what + (f" ({more} more sentence{'s' if more > 1 else ''} too long)"
                                 if more else ""), fix))
    if problems:
        raise UsageError("; ".join(what for what, _ in problems),
                         fix="; ".join(fix for _, fix in problems))
    return Batch(list(sentences), tokens)


def hashed_vector(token: str, width: int) -> torch.Tensor:
    """N(0, 1) vector seeded by the token's stable hash."""
    import torch

    gen = torch.Generator().manual_seed(token_hash(token) & (2**63 - 1))
    return torch.randn(width, generator=gen)


def sinusoidal(length: int, width: int) -> torch.Tensor:
    """(L, width) sinusoidal position encoding (Vaswani et al., 2017)."""
    import torch

    position = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    enc = torch.zeros(length, width)
    enc[:, 0::2] = torch.sin(position * freq)
    enc[:, 1::2] = torch.cos(position * freq)[:, : width // 2]
    return enc


@dataclass(frozen=True)
class Vocabulary:
    embedding_key: str
    ids: dict[str, int]
    unk_id: int | None
    source: str


def find_vocabulary(store: TensorStore, width: int) -> Vocabulary | None:
    """An embedding table of `width` columns plus a vocabulary file beside the checkpoint."""
    if store.folder is None:
        return None
    table = next((k for k in store.keys() if k.endswith(EMBEDDING_SUFFIXES)
                  and len(store.info(k).shape) == 2 and store.info(k).shape[1] == width), None)
    if table is None:
        return None
    rows = store.info(table).shape[0]
    ids = _read_vocab(store.folder)
    if not ids:
        return None
    ids = {word: i for word, i in ids.items() if 0 <= i < rows}
    unk = next((ids[t] for t in ("[UNK]", "<unk>", "<|endoftext|>") if t in ids), None)
    return Vocabulary(table, ids, unk, printable_path(store.folder))


MAX_VOCAB_TXT_BYTES = 32 * 2**20  # a 250,000-word vocab.txt is ~4 MB
MAX_TOKENIZER_JSON_BYTES = 64 * 2**20  # the largest hub tokenizer.json files are ~35 MB


def _read_vocab(folder: Path) -> dict[str, int]:
    """word → id from vocab.txt or tokenizer.json's model.vocab, each read within a size cap;
    {} when neither is there or tokenizer.json has no word → id map."""
    vocab_txt = folder / "vocab.txt"
    if os.path.lexists(vocab_txt):
        raw = read_capped(vocab_txt, MAX_VOCAB_TXT_BYTES, "vocab.txt")
        lines = raw.decode("utf-8", errors="replace").split("\n")
        return {word.rstrip("\r"): i for i, word in enumerate(lines) if word.rstrip("\r")}
    tokenizer_json = folder / "tokenizer.json"
    if os.path.lexists(tokenizer_json):
        raw = read_capped(tokenizer_json, MAX_TOKENIZER_JSON_BYTES, "tokenizer.json")
        data = parse_json(raw, "tokenizer.json", printable_path(tokenizer_json), finite=False)
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):
            return {w: i for w, i in vocab.items() if isinstance(w, str) and type(i) is int}
    return {}


def lookup(vocab: Vocabulary, token: str) -> int | None:
    for candidate in (token, "Ġ" + token, "▁" + token):
        if candidate in vocab.ids:
            return vocab.ids[candidate]
    return vocab.unk_id


def input_vectors(batch: Batch, width: int, store: TensorStore | None = None,
                  positions: str = "none") -> tuple[torch.Tensor, str]:
    """(B, L, width) float32 inputs, zero at padding, and a sentence describing them."""
    import torch

    vocab = find_vocabulary(store, width) if store is not None else None
    rows: dict[int, torch.Tensor] = {}
    if vocab is not None and store is not None:
        # Only the rows of the tokens used are read, never the whole table (a large
        # vocabulary's embedding is gigabytes).
        wanted = {lookup(vocab, token) for tokens in batch.tokens for token in tokens}
        rows = {row: store.read_rows(vocab.embedding_key, row, row + 1)[0].float()
                for row in sorted(r for r in wanted if r is not None)}
    x = torch.zeros(len(batch.tokens), batch.max_len, width)
    found = 0
    # a repeated word is drawn once (long texts repeat most words)
    hashed: dict[str, torch.Tensor] = {}
    for b, tokens in enumerate(batch.tokens):
        for i, token in enumerate(tokens):
            row = lookup(vocab, token) if vocab is not None else None
            if row is not None and row in rows:
                x[b, i] = rows[row]
                found += 1
            else:
                if token not in hashed:
                    hashed[token] = hashed_vector(token, width)
                x[b, i] = hashed[token]
    if vocab is not None:
        described = (f"rows of the checkpoint's embedding table {vocab.embedding_key} "
                     f"({found} of {sum(batch.lengths)} tokens found in its vocabulary, the rest "
                     "hashed)")
    else:
        described = "deterministic N(0, 1) vectors seeded by each token's BLAKE2b hash"
    if positions == "sinusoidal":
        x = x + sinusoidal(batch.max_len, width)[None]
        described += " + sinusoidal positions"
    for b, length in enumerate(batch.lengths):
        x[b, length:] = 0.0
    return x, described


def padding_mask(batch: Batch) -> torch.Tensor:
    """(B, L) bool, True at padding (nn.MultiheadAttention's key_padding_mask convention)."""
    import torch

    lengths = torch.tensor(batch.lengths)
    return torch.arange(batch.max_len)[None, :] >= lengths[:, None]


def find_query(tokens: list[str], spec: str) -> int:
    """--query INDEX (negative counts from the end) or TOKEN (its first occurrence)."""
    try:
        index = int(spec)
    except ValueError:
        if spec.lower() in tokens:
            return tokens.index(spec.lower())
        raise UsageError(f"token {spec!r} is not in the sentence",
                         fix=f"choose one of {', '.join(dict.fromkeys(tokens))}",
                         option="query") from None
    if not -len(tokens) <= index < len(tokens):
        raise UsageError(f"query index {index} is out of range",
                         fix=f"the sentence has {len(tokens)} tokens", option="query")
    return index % len(tokens)
