"""The source `attribute` and `lens` run on — the bundled model (nothing given) or a Hugging
Face causal LM (`model`), opened through the one source registry — and what both do with it:
prompts tokenized, positions resolved, the answer and the wrong token resolved to ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from attnviz.compute.logit.logit_run import LogitRun
from attnviz.core.choices import Dtype
from attnviz.errors import UsageError, option

# the bundled model's built-in prompt: an induction repeat, whose next word is "mat"
BUNDLED_PROMPT = "the cat sat on the mat and the dog sat on the rug the cat sat on the"
MAX_PROMPTS = 64


class LogitSource(Protocol):
    """What `attribute` and `lens` need of a model (sources.logit_bundled,
    sources.hf.residual_parts)."""

    def tokenize(self, text: str) -> tuple[list[int], list[str]]: ...

    def token_id(self, text: str, what: str) -> int: ...

    def prompt(self, text: str) -> tuple[list[int], list[str]]: ...

    def piece(self, text: str) -> tuple[list[int], list[str]]: ...

    def name_of(self, token_id: int) -> str: ...

    def run(self, prompts: list[list[int]], tokens: list[list[str]], positions: list[int],
            lens_positions: list[list[int]] | None) -> LogitRun: ...


@dataclass(frozen=True)
class Encoded:
    """Prompts as ids and token names, each with its chosen position."""

    texts: list[str]
    ids: list[list[int]]
    tokens: list[list[str]]
    positions: list[int]


def open_logit_source(model: str | None, device: str, dtype: Dtype) -> LogitSource:
    """The bundled model (model None) or the --model folder's causal LM, loaded."""
    from attnviz.compute.device import resolve_device
    from attnviz.core.request import SourceSpec
    from attnviz.sources.registry import open_model_source, open_source

    if model is None:
        if dtype is not Dtype.FLOAT32:
            raise UsageError(f"{option('dtype')} applies to {option('model')} only (the "
                             "bundled model runs in float32)", option="dtype")
        from attnviz.sources.logit_bundled import BundledLogits

        return BundledLogits(open_source(SourceSpec()).store, resolve_device(device))
    from attnviz.sources.hf.load import check_load_options
    from attnviz.sources.hf.residual_parts import ModelLogits, load_lm

    check_load_options(device, dtype.value, None)
    opened = open_model_source(SourceSpec(model=model, device=device, dtype=dtype))
    return ModelLogits(opened, load_lm(opened, resolve_device(device), dtype.value))


def encode(source: LogitSource, texts: list[str], position: int) -> Encoded:
    """Each prompt's ids, tokens and position (`position` counts from the end when negative)."""
    ids, tokens, positions = [], [], []
    for n, text in enumerate(texts):
        i, t = source.tokenize(text)
        ids.append(i)
        tokens.append(t)
        positions.append(resolve_position(position, len(i), f"prompt {n + 1}"))
    return Encoded(texts, ids, tokens, positions)


def resolve_position(position: int, length: int, which: str) -> int:
    """A position given as an index (negative: from the end) within `length` tokens."""
    at = position + length if position < 0 else position
    if not 0 <= at < length:
        raise UsageError(f"position {position} is outside {which} ({length} tokens)",
                         fix=f"give {option('position')} from {-length} to {length - 1}",
                         option="position")
    return at
