"""Choices a command takes as one option, as `str` Enums: the CLI's Typer options take them (Typer
lists the values in --help and refuses others), the request dataclasses hold them, and the
Python API parses its strings into them once, where it builds the request (`Choice.parse`), so
nothing below checks them again. A member is its value: `str()`, f-strings and JSON print
`max`, never `ColorScale.MAX`."""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from attnviz.errors import UsageError, option

_C = TypeVar("_C", bound="Choice")


class Choice(str, Enum):
    """One option's values; `parse` turns the API's string into a member, or one usage error
    naming the option and listing every value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(str(member.value) for member in cls)

    @classmethod
    def parse(cls: type[_C], value: object, name: str) -> _C:
        """`value` (a member or its string) as a member of `cls`; `name`: the option's keyword."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        for member in cls:
            if member.value == value:
                return member
        raise UsageError(f"unknown {option(name)} {value!r}",
                         fix=f"use {', '.join(cls.values())}", option=name)


class ColorScale(Choice):
    """--scale: the colour scale of maps and figures."""

    MAX = "max"  # 0 to the largest weight shown
    FIXED = "fixed"  # 0 to 1
    LOG = "log"  # 3 decades below the largest


class Weighting(Choice):
    """--weighting: what a cell shows."""

    ATTENTION = "attention"  # the weight α_ij
    NORM = "norm"  # ‖α_ij · W_O^h v_j‖, rows normalized (attnviz.app.weighting)


class AblationMode(Choice):
    """What replaces a removed head's slice of the input to W_O (attnviz ablate --mode)."""

    ZERO = "zero"  # zeroed
    MEAN = "mean"  # its mean over the batch's real tokens


class Positions(Choice):
    """--positions: encodings added to a standalone layer's inputs."""

    NONE = "none"
    SINUSOIDAL = "sinusoidal"


class Dtype(Choice):
    """--dtype: what a --model's weights are loaded as."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    AUTO = "auto"  # the checkpoint's own


class OverviewShows(Choice):
    """--overview: what a cell of the layers × heads grid shows: the head's type (label), one
    statistic (attnviz.compute.measures.overview.STATISTICS, which a test keeps equal to these), the
    causal scorecard's effect (attnviz ablate), or nothing (off)."""

    LABEL = "label"
    ENTROPY = "entropy"
    MAX = "max"
    DISTANCE = "distance"
    FIRST = "first"
    PREVIOUS = "previous"
    LAST = "last"
    SPECIAL = "special"
    SELF = "self"
    DUPLICATE = "duplicate"
    INDUCTION = "induction"
    NEXT = "next"
    PUNCTUATION = "punctuation"
    ABLATION = "ablation"
    OFF = "off"


class Probe(Choice):
    """--probe: an input made to show one head type (attnviz.core.probe)."""

    INDUCTION = "induction"


class PatchMetric(Choice):
    """--metric of attnviz patch: what a run is scored by (attnviz.compute.patching.metric)."""

    LOGIT_DIFF = "logit-diff"  # logit(answer) − logit(wrong) at the prompt's last token
    LOGPROB = "logprob"  # log p(answer) at the prompt's last token
    LOSS = "loss"  # mean next-token loss over the answer, taken as a continuation


class PatchDirection(Choice):
    """--direction of attnviz patch: which run is patched with which run's activations."""

    DENOISING = "denoising"  # the corrupted run, patched with the clean run's activations
    NOISING = "noising"  # the clean run, patched with the corrupted run's activations


class PatchSite(Choice):
    """--site of attnviz patch: which activation is patched (attnviz.compute.patching.sites)."""

    HEADS = "heads"  # each head's output: its slice of the input to W_O
    RESIDUAL = "residual"  # the residual stream entering each layer (causal tracing)
    Q = "q"  # each head's query
    K = "k"  # each key/value head's key (grouped-query: shared by its query heads)
    V = "v"  # each key/value head's value
    PATTERN = "pattern"  # each head's attention pattern
    PATH = "path"  # exact path patching: each sender head → --receiver (or the logits)
    ATTRIBUTION = "attribution"  # first-order attribution patching beside exact head patching
class HeadReduce(Choice):
    """--heads of `attnviz tokens`: how one layer's heads become one map for rollout and flow."""

    MEAN = "mean"
    MAX = "max"  # vit-explain's option: the strongest head per cell
    MIN = "min"


class TokenMethod(Choice):
    """--method of `attnviz tokens`: how much each input token reaches the output position."""

    ROLLOUT = "rollout"  # attention rollout (Abnar & Zuidema 2020)
    FLOW = "flow"  # attention flow: exact max flow in the layered graph (Abnar & Zuidema 2020)
    NORMS = "norms"  # ‖per-source term‖ with residual and norm (Kobayashi et al. 2021), composed
    ALTI = "alti"  # ALTI (Ferrando et al. 2022): L1 proximity of each term to the output


class Erase(Choice):
    """--erase of `attnviz tokens`: how leave-one-out removes one input token."""

    MASK = "mask"  # masked as the model masks padding: no query attends to it
    BASELINE = "baseline"  # replaced by a baseline token (--baseline)
class LongExamples(Choice):
    """--long (attnviz corpus): an example longer than --max-tokens."""

    TRUNCATE = "truncate"  # its first --max-tokens tokens
    SKIP = "skip"  # left out (counted)


class CorpusShows(Choice):
    """--overview (attnviz corpus): what a cell of the layers × heads grid shows."""

    LABEL = "label"  # the head's type and its bootstrap stability
    ENTROPY = "entropy"
    MAX = "max"
    DISTANCE = "distance"
    FIRST = "first"
    PREVIOUS = "previous"
    LAST = "last"
    SPECIAL = "special"
    SELF = "self"
    DUPLICATE = "duplicate"
    INDUCTION = "induction"
    NEXT = "next"
    PUNCTUATION = "punctuation"


class LayerKind(Choice):
    """What kind of attention a shown layer is (not an option: a model's layers say it)."""

    SELF = "self"  # encoder, encoder-only or decoder-only self-attention
    DECODER_SELF = "decoder-self"  # an encoder-decoder model's (causal) decoder self-attention
    CROSS = "cross"  # decoder queries over encoder keys: maps are (B, H, T, S)
