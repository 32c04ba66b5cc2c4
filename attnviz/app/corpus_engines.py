"""The forward pass of a corpus run, per source: heatmap's own paths, opened once and run on
batch after batch. `BundledEngine` runs the bundled model (`sources.bundled.run_tiny`);
`ModelEngine` a Hugging Face model through `sources.hf.layers.plan_run` and `run_plan`, full
maps kept (never streamed); both weigh the maps with `--weighting norm` as heatmap does
(`app.weighting.weigh_run`). An engine tokenizes each example alone (`tokenize`: lengths
known before batching), runs a batch of tokenized examples (`run`), and says who it is
(`identity`: what a resumed run must find unchanged)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from attnviz.core.choices import LongExamples
from attnviz.core.request import SourceSpec
from attnviz.errors import CheckpointError

if TYPE_CHECKING:
    from attnviz.app.corpus_input import Example
    from attnviz.compute.forward_pass.results import AttentionRun

HEADER_BYTES = 1 << 16  # a model file's first 64 KiB (a safetensors header) name its content


@dataclass(frozen=True)
class Tokenized:
    """One example, ready to batch: its text, tokens (or the tokenizer's row) and length."""

    ordinal: int
    text: str
    length: int
    payload: Any  # the bundled model: its words; a model: the tokenizer's output
    truncated: bool = False


class Engine(Protocol):
    layers: int  # attention calls per forward (config's count until the first run)
    heads: int  # the most heads a layer has

    def tokenize(self, examples: list[Example], max_tokens: int, long: LongExamples
                 ) -> list[Tokenized | None]: ...

    def run(self, items: list[Tokenized]) -> AttentionRun: ...

    def identity(self) -> dict[str, Any]: ...

    def name(self) -> str: ...


def files_identity(paths: list[Path]) -> str:
    """A hash of each file's name, size and first 64 KiB (the header of a safetensors file)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(paths):
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        digest.update(f"{path.name}\0{size}\0".encode() + head)
    return digest.hexdigest()


def _fit(length: int, limit: int, long: LongExamples) -> int | None:
    """The tokens kept of an example of `length` (None: skipped)."""
    if length <= limit:
        return length
    return limit if long is LongExamples.TRUNCATE else None


class BundledEngine:
    """The bundled 2-layer model, whole, with its own hashed-word tokens."""

    def __init__(self, device: str, norm: bool) -> None:
        from attnviz.compute.forward_pass.device import resolve_device
        from attnviz.sources.bundled import tiny_layers, token_limit
        from attnviz.sources.registry import open_source

        self.store = open_source(SourceSpec()).store
        self.limit = token_limit(self.store).tokens
        found = tiny_layers(self.store)
        self.layers, self.heads = len(found), max(layer.num_heads or 0 for layer in found)
        self.device, self.norm = resolve_device(device), norm

    def tokenize(self, examples: list[Example], max_tokens: int, long: LongExamples
                 ) -> list[Tokenized | None]:
        """Each example's words (None: no word, or too long and skipped)."""
        from attnviz.core.words import split_words

        out: list[Tokenized | None] = []
        for example in examples:
            words = split_words(example.text)
            kept = _fit(len(words), min(max_tokens, self.limit), long)
            out.append(None if not words or kept is None else Tokenized(
                example.ordinal, example.text, kept, words[:kept], kept < len(words)))
        return out

    def run(self, items: list[Tokenized]) -> AttentionRun:
        from attnviz.compute.forward_pass.inputs import Batch
        from attnviz.sources.bundled import run_tiny

        run = run_tiny(self.store, Batch([i.text for i in items], [i.payload for i in items]),
                       None, self.device)
        return _weighed(run, self.norm)

    def identity(self) -> dict[str, Any]:
        from attnviz.data import BUNDLED

        return {"source": "bundled", "files": files_identity([BUNDLED])}

    def name(self) -> str:
        return "the bundled model"


class ModelEngine:
    """A Hugging Face model (--model), loaded once; each batch through heatmap's capture."""

    def __init__(self, spec: SourceSpec, memory_budget: int | None, norm: bool) -> None:
        from attnviz.sources.hf.layers import HEAD_FIELDS, LAYER_FIELDS, config_count
        from attnviz.sources.hf.load import check_load_options, load_weights
        from attnviz.sources.registry import open_model_source

        check_load_options(spec.device, spec.dtype, spec.device_map, spec.max_memory)
        self.opened = open_model_source(spec)
        self.loaded = load_weights(self.opened, spec.device, spec.dtype, spec.device_map,
                                      spec.max_memory)
        config = self.loaded.config
        self.layers = config_count(config, LAYER_FIELDS) or 12
        self.heads = config_count(config, HEAD_FIELDS) or 12
        self.memory_budget, self.norm, self.spec = memory_budget, norm, spec

    def tokenize(self, examples: list[Example], max_tokens: int, long: LongExamples
                 ) -> list[Tokenized | None]:
        """Each example through the model's own tokenizer, special tokens included (None: too
        long and skipped); one silenced call per window (a tokenizer's warnings, and a Rust
        panic's message, never reach the terminal)."""
        from attnviz.sources.hf import guard

        with guard.silenced(stderr=True):
            return [self._tokenize(e.ordinal, e.text, max_tokens, long) for e in examples]

    def _tokenize(self, ordinal: int, text: str, max_tokens: int, long: LongExamples
                  ) -> Tokenized | None:
        limit = min(max_tokens, self.loaded.position_limit or max_tokens)
        tokenizer = self.loaded.tokenizer
        row = dict(tokenizer(text, add_special_tokens=True))
        full = len(row["input_ids"])
        kept = _fit(full, limit, long)
        if full == 0 or kept is None:
            return None
        if kept < full:  # the tokenizer cuts it, its special tokens kept
            row = dict(tokenizer(text, add_special_tokens=True, truncation=True,
                                 max_length=kept))
        ids = row["input_ids"]
        if not ids or len(ids) > limit or not all(0 <= t < self.loaded.embedding_rows
                                                  for t in ids):
            raise CheckpointError("the model's tokenizer gives token ids outside its embedding "
                                  f"(example {ordinal + 1})", fix="the tokenizer files belong "
                                  "to another model", where=str(self.loaded.folder))
        return Tokenized(ordinal, text, len(ids), row, kept < full)

    def run(self, items: list[Tokenized]) -> AttentionRun:
        from attnviz.sources.hf.inputs import Encoded
        from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run
        from attnviz.sources.hf.run import run_plan

        texts = [i.text for i in items]
        how = ModelRun(False, None, self.memory_budget, self.norm, views=False)
        plan = plan_run(self.loaded, RunInputs(texts, None, max(i.length for i in items),
                                                     Encoded([i.payload for i in items])),
                           None, how)
        run = run_plan(self.loaded, plan)
        self.layers, self.heads = len(run.layers), max(layer.heads for layer in run.layers)
        return _weighed(run, self.norm)

    def identity(self) -> dict[str, Any]:
        folder = Path(self.loaded.folder)
        files = [p for p in folder.iterdir() if p.is_file()]
        return {"source": "model", "files": files_identity(files),
                "dtype": str(self.spec.dtype)}

    def name(self) -> str:
        from attnviz.app.naming import display_name

        name = display_name(str(self.loaded.folder))
        dtype = str(self.spec.dtype)
        return name if dtype == "float32" else f"{name} ({dtype})"


def _weighed(run: AttentionRun, norm: bool) -> AttentionRun:
    if norm:
        from attnviz.app.weighting import weigh_run

        return weigh_run(run)
    return run


def open_engine(spec: SourceSpec, memory_budget: int | None, norm: bool) -> Engine:
    """The engine of the source `spec` names: the bundled model, or --model."""
    if spec.model is not None:
        return ModelEngine(spec, memory_budget, norm)
    return BundledEngine(spec.device, norm)
