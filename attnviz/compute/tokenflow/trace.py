"""What a source hands the `tokens` command for one sentence: the per-layer maps, the blocks'
per-source terms, and the leave-one-out effects. The methods only read these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnviz.compute.tokenflow.cross_parts import CrossBlocks
from attnviz.compute.tokenflow.decompose import BlockTerms


@dataclass
class TokenTrace:
    """One sentence through one stack of layers (real tokens only)."""

    tokens: list[str]
    maps: list[torch.Tensor]  # per layer (H, L, L), [head, query, key]
    blocks: list[BlockTerms] | None  # per layer; None where the source cannot decompose
    block_outputs: list[torch.Tensor] | None = None  # per layer (L, E): the model's own output
    layer_names: list[str] = field(default_factory=list)


@dataclass
class Erasures:
    """Leave-one-out for one sentence: the output measured with each token erased."""

    erased: list[int]  # token indices erased, one copy each
    effects: torch.Tensor  # (len(erased),) float64: the measure's drop (logit) or change (vector)
    measure: str  # what was measured, in words
    how: str  # how a token was erased, in words
    base_value: float | None = None  # the unerased measure (a log-probability), if scalar


@dataclass
class CrossTrace:
    """One sentence through an encoder-decoder with its target: the decoder's view."""

    source: list[str]  # the encoder's tokens
    target: list[str]  # the decoder's tokens (its start token first)
    encoder: list[torch.Tensor]  # per encoder layer (H, S, S)
    decoder: list[torch.Tensor]  # per decoder layer (H, T, T)
    cross: list[torch.Tensor]  # per decoder layer (H, T, S)
    # the per-source terms (compute/tokenflow/cross_parts.py), None where the source cannot
    # decompose the family
    blocks: CrossBlocks | None = None
