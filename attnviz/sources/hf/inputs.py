"""Sentences (and targets) encoded by the model's own tokenizer, limits checked, padded on
the tokenizer's side."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.forward_pass.inputs import Batch, TokenLimit, length_problem
from attnviz.core.request import DEFAULT_MAX_TOKENS
from attnviz.errors import (
    CheckpointError,
    UsageError,
    option,
    printable,
    printable_path,
)
from attnviz.sources.hf import guard, tokenizer_bound
from attnviz.sources.hf.load import LoadedModel, OpenedModel, input_device
from attnviz.sources.hf.token_names import token_names


@dataclass
class Prepared:
    """A padded batch ready for the model, and where each sentence's real tokens sit in it."""

    runner: Any  # the module whose forward runs: the model, or an encoder-decoder's encoder
    runner_name: str  # its name in the model ("" for the model itself, "encoder")
    feed: dict[str, torch.Tensor]
    batch: Batch  # source sentences and their tokens
    offsets: list[int]  # per sentence: the padded index of its first real token
    target: Batch | None = None  # decoder inputs (target text and decoder tokens)
    target_offsets: list[int] | None = None  # always 0: targets are right-padded

    def tiny(self) -> dict[str, torch.Tensor]:
        """The first sentence's first real token (and the decoder's start token): a probe."""
        first = self.offsets[0]
        out = {}
        for name, value in self.feed.items():
            start = 0 if name.startswith("decoder_") else first
            out[name] = value[:1, start:start + 1]
        return out


@dataclass
class Encoded:
    """Sentences (and targets) tokenized, every limit checked: the model can take them."""

    rows: list[dict[str, list]]  # per sentence: the tokenizer's output
    target_rows: list[dict[str, list]] | None = None


def encode(model: OpenedModel | LoadedModel, sentences: list[str],
           targets: list[str] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS) -> Encoded:
    """Each sentence (and target) tokenized alone, special tokens included, and every limit
    that applies checked at once: run before the weights load, so a too-long input costs
    nothing."""
    if targets is not None and not model.encoder_decoder:
        raise UsageError(f"{option('target')} applies to encoder-decoder models only",
                         fix=f"drop {option('target')}", option="target")
    if targets is not None and len(targets) != len(sentences):
        raise UsageError(f"{len(targets)} {option('target')} texts for {len(sentences)} sentences",
                         fix=f"give one {option('target')} per sentence, in order", option="target")
    rows = _encode(model, sentences, max_tokens)
    target_rows = None if targets is None else _encode(model, targets, max_tokens, option("target"),
                                                        target=True)
    return Encoded(rows, target_rows)


def prepare(loaded: LoadedModel, sentences: list[str], targets: list[str] | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, encoded: Encoded | None = None) -> Prepared:
    """The encoded sentences padded on the tokenizer's side with the model's attention mask.
    With targets (encoder-decoder models only), the decoder input of sentence i is the decoder
    start token followed by target i's tokens, right-padded. `encoded`: the inputs as `encode`
    checked them before the weights loaded (encoded here otherwise)."""
    if encoded is None:
        encoded = encode(loaded, sentences, targets, max_tokens)
    rows = encoded.rows
    # `<id N>` for an id the tokenizer has no token for (a generated one, see token_names)
    tokens = [token_names(loaded.tokenizer, row["input_ids"]) for row in rows]
    runner, runner_name = loaded.model, ""
    if loaded.tower is not None:  # a multi-tower model (CLIP): its text tower runs alone
        runner, runner_name = getattr(loaded.model, loaded.tower), loaded.tower
    elif loaded.encoder_decoder and targets is None:
        runner = loaded.model.get_encoder()
        runner_name = next((n for n, m in loaded.model.named_modules() if m is runner), "")
    feed, offsets = _pad(loaded, runner, rows)
    prepared = Prepared(runner, runner_name, feed, Batch(list(sentences), tokens), offsets)
    if targets is not None:
        _add_targets(loaded, prepared, targets, encoded.target_rows or [])
    return prepared


def _encode(model: OpenedModel | LoadedModel, sentences: list[str], max_tokens: int,
            what: str = "sentence", target: bool = False) -> list[dict[str, list]]:
    """Each text tokenized alone, special tokens included; limits checked before any run."""
    if not sentences:
        raise UsageError("no sentence given",
                         fix=f"pass one or more sentences, or {option('file')} FILE")
    model_limit = model.position_limit
    where = printable_path(model.folder)
    with guard.contained("the model's tokenizer cannot be read", "check its tokenizer.json",
                         where):
        steps = tokenizer_bound.chain_of(model.tokenizer)
    out = []
    for i, sentence in enumerate(sentences, 1):
        # what the normalizers can make of it, bounded before the text reaches Rust
        tokenizer_bound.check_text_bound(steps, len(sentence), f"{what} {i}", where)
        row = _tokenize(model, sentence, f"{what} {i}", target, where)
        n = len(row["input_ids"]) + (1 if target else 0)  # the decoder start token
        if n == 0 or not sentence.strip():
            raise UsageError(f"{what} {i} gives no tokens", fix="give it some text")
        check_length(f"{what} {i}", n, max_tokens, model_limit)
        out.append(row)
    _check_not_all_unknown(model, out)
    return out


def check_length(what: str, n: int, max_tokens: int, model_limit: int | None) -> None:
    """One error naming every limit a text of n tokens passes, with a fix that is enough."""
    limit = None if model_limit is None else TokenLimit(model_limit, "the model")
    problem = length_problem(what, n, max_tokens, limit, "it")
    if problem is not None:
        raise UsageError(problem[0], fix=problem[1])


def _tokenize(model: OpenedModel | LoadedModel, text: str, what: str, target: bool,
              where: str) -> dict[str, list]:
    """The tokenizer's output for one text, its ids checked against the embedding's rows."""
    # A tokenizer can fail in Rust (a panic surfaces as a BaseException): contained.
    with guard.silenced(stderr=True), \
            guard.contained(f"the model's tokenizer failed on {what}",
                               "check or replace its tokenizer files", where):
        if target:
            row = dict(model.tokenizer(text_target=text, add_special_tokens=True))
        else:
            row = dict(model.tokenizer(text, add_special_tokens=True))
        ids = row.get("input_ids")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise CheckpointError(f"the model's tokenizer gave no token ids for {what}",
                                  fix="check its tokenizer files", where=where)
    rows = model.embedding_rows
    if ids and not all(0 <= t < rows for t in ids):
        raise CheckpointError(f"the model's tokenizer gives token id "
                              f"{max(ids) if max(ids) >= rows else min(ids)}, "
                              f"but the model's embedding has {rows} rows",
                              fix="the tokenizer files belong to another model", where=where)
    return row


def _check_not_all_unknown(loaded: OpenedModel | LoadedModel, rows: list[dict[str, list]]) -> None:
    """A tokenizer that maps every word to its unknown token (a vocabulary that does not belong
    to the model, or none) would show maps of [UNK] tokens: refuse instead."""
    tok = loaded.tokenizer
    unk = getattr(tok, "unk_token_id", None)
    special = set(getattr(tok, "all_special_ids", None) or []) - {unk}
    words = [t for row in rows for t in row["input_ids"] if t not in special]
    if isinstance(unk, int) and words and all(t == unk for t in words):
        raise CheckpointError("the model's tokenizer maps every word of the sentences to its "
                              "unknown token", fix="check that the tokenizer files belong to the "
                              "model", where=printable_path(loaded.folder))


def _filler(loaded: LoadedModel) -> int:
    """An id for padded positions: any id the embedding table has will do, they are masked."""
    tok = loaded.tokenizer
    vocab = loaded.embeddings.num_embeddings
    return next((i for i in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id)
                 if isinstance(i, int) and 0 <= i < vocab), 0)


def _pad(loaded: LoadedModel, runner: Any, rows: list[dict[str, list]]
         ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Padded model inputs on the tokenizer's padding side, and each sentence's offset.

    Padding is done here rather than by the tokenizer so that tokenizers without a pad token
    (GPT-2, LLaMA) need no change.
    """
    left = getattr(loaded.tokenizer, "padding_side", "right") == "left"
    length = max(len(row["input_ids"]) for row in rows)
    rows = [{**row, "attention_mask": [1] * len(row["input_ids"])} for row in rows]
    fills = {"input_ids": _filler(loaded)}  # attention_mask and token_type_ids pad with 0
    # Tokenizers may return inputs the model does not take (token_type_ids for LLaMA in 4.x).
    accepts = inspect.signature(runner.forward).parameters
    feed: dict[str, torch.Tensor] = {}
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        if name not in rows[0] or name not in accepts:
            continue
        padded = []
        for row in rows:
            pad = [fills.get(name, 0)] * (length - len(row[name]))
            padded.append(pad + row[name] if left else row[name] + pad)
        feed[name] = torch.tensor(padded)
    if "attention_mask" not in feed:
        raise CheckpointError(f"{type(runner).__name__}'s forward takes no attention_mask, so it "
                              "has no attention over tokens attnviz can capture (FNet mixes "
                              "tokens with Fourier transforms)",
                              fix="attnviz shows the attention maps of models that take a mask")
    mask = feed["attention_mask"]
    if left and "position_ids" in accepts:
        # As generate() does: real tokens count from 0 after left padding, so learned absolute
        # positions (GPT-2) match a sentence run alone. Right padding keeps the model's default.
        feed["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    offsets = [length - len(row["input_ids"]) if left else 0 for row in rows]
    device = input_device(loaded.model)
    return {k: v.to(device) for k, v in feed.items()}, offsets


def _add_targets(loaded: LoadedModel, prepared: Prepared, targets: list[str],
                 rows: list[dict[str, list]]) -> None:
    start = getattr(loaded.config, "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise CheckpointError("the model's config has no decoder_start_token_id",
                              fix="add it to config.json", where=printable(str(loaded.folder)))
    ids = [[start, *row["input_ids"]] for row in rows]
    length = max(len(row) for row in ids)
    filler = _filler(loaded)
    device = input_device(loaded.model)
    prepared.feed["decoder_input_ids"] = torch.tensor(
        [row + [filler] * (length - len(row)) for row in ids], device=device)
    if "decoder_attention_mask" in inspect.signature(loaded.model.forward).parameters:
        prepared.feed["decoder_attention_mask"] = torch.tensor(
            [[1] * len(row) + [0] * (length - len(row)) for row in ids], device=device)
    tokens = [token_names(loaded.tokenizer, row) for row in ids]
    prepared.target = Batch(list(targets), tokens)
    prepared.target_offsets = [0] * len(ids)


# --- layers ------------------------------------------------------------------------------------
