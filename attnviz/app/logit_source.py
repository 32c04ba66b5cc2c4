"""The source `attribute` and `lens` run on — the bundled model (nothing given) or a Hugging
Face causal LM (`model`), opened through the one source registry — and what both do with it:
prompts tokenized, positions resolved, the answer and the wrong token resolved to ids."""

from __future__ import annotations

from typing import Protocol

from attnviz.compute.logit.logit_run import LogitRun, Prompts
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

    encoder_decoder: bool

    def target(self, text: str) -> tuple[list[int], list[str]]: ...

    def run(self, prompts: Prompts, lens_positions: list[list[int]] | None) -> LogitRun: ...


def open_logit_source(model: str | None, device: str, dtype: Dtype) -> LogitSource:
    """The bundled model (model None) or the --model folder's causal LM, loaded."""
    from attnviz.compute.forward_pass.device import resolve_device
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


def encode(source: LogitSource, texts: list[str], position: int,
           targets: list[str] | None = None) -> Prompts:
    """Each prompt's ids, tokens and position (`position` counts from the end when negative);
    an encoder-decoder's positions are its decoder's: the start token and `targets`, one per
    prompt."""
    check_targets(source, texts, targets)
    ids, tokens, positions = [], [], []
    encoder_ids: list[list[int]] | None = [] if targets else None
    for n, text in enumerate(texts):
        i, t = source.tokenize(text)
        if targets and encoder_ids is not None:
            encoder_ids.append(i)
            i, t = source.target(targets[n])
        ids.append(i)
        tokens.append(t)
        positions.append(resolve_position(position, len(i), f"prompt {n + 1}"))
    shown = texts if not targets else [f"{t} (decoder: {g})" for t, g in zip(texts, targets,
                                                                              strict=True)]
    return Prompts(shown, ids, tokens, positions, encoder_ids)


def check_targets(source: LogitSource, texts: list[str], targets: list[str] | None) -> None:
    """An encoder-decoder reads at its decoder: one target per prompt, and only there."""
    if source.encoder_decoder and not targets:
        raise UsageError("an encoder-decoder model is read at its decoder: it needs the "
                         "decoder's text", fix=f"give {option('target')} TEXT (one per "
                         "prompt; the answer is the token that would follow it)",
                         option="target")
    if targets and not source.encoder_decoder:
        raise UsageError(f"{option('target')} applies to encoder-decoder models only",
                         fix=f"drop {option('target')}", option="target")
    if targets and len(targets) != len(texts):
        raise UsageError(f"{len(targets)} targets for {len(texts)} prompts",
                         fix=f"give one {option('target')} per prompt", option="target")


def resolve_position(position: int, length: int, which: str) -> int:
    """A position given as an index (negative: from the end) within `length` tokens."""
    at = position + length if position < 0 else position
    if not 0 <= at < length:
        raise UsageError(f"position {position} is outside {which} ({length} tokens)",
                         fix=f"give {option('position')} from {-length} to {length - 1}",
                         option="position")
    return at
