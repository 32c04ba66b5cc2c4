"""What a source hands to `attribute` and `lens`: one forward over B prompts, read at each
prompt's chosen position, with everything needed to decompose it — no model object, tensors
only, so the arithmetic is the same for the bundled model and a Hugging Face model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from attnviz.compute.logit.frozen_norm import FrozenNorm
from attnviz.compute.logit.residual_parts_data import ResidualParts


@dataclass(frozen=True)
class Prompts:
    """Prompts as ids, each read at one position. An encoder-decoder's `ids` are its decoder
    inputs (start token + target), and `encoder_ids` the prompts the encoder reads."""

    texts: list[str]
    ids: list[list[int]]
    tokens: list[list[str]]
    positions: list[int]
    encoder_ids: list[list[int]] | None = None


@dataclass(frozen=True)
class LogitTransform:
    """What the model does to its logits after the unembedding: a factor (Cohere's
    logit_scale, 1/Granite's logits_scaling), then a softcap (Gemma-2's final_logit_softcapping)."""

    factor: float = 1.0
    softcap: float | None = None

    def describe(self) -> str:
        said = []
        if self.factor != 1.0:
            said.append(f"logits × {self.factor:g}")
        if self.softcap is not None:
            said.append(f"final logit softcap {self.softcap:g}·tanh(z/{self.softcap:g})")
        return ", ".join(said) or "none"


@dataclass(frozen=True)
class LensRows:
    """The lens's inputs, kept small: each prompt's residual rows at its chosen positions
    (R, P, E), and the model's own map from residual rows to logits (its final norm — each
    row's own statistics —, its head, its logit transform). Logits are made a row at a time,
    so R × P × V never sits in memory at once."""

    states: list[torch.Tensor]  # per prompt (R, P, E)
    to_logits: Callable[[torch.Tensor], torch.Tensor]  # (P, E) -> (P, V)

    def rows(self, prompt: int) -> Iterator[torch.Tensor]:
        """Prompt `prompt`'s logits, row by row: (P, V) each, on the CPU."""
        for state in self.states[prompt]:
            yield self.to_logits(state).float().cpu()

    def stacked(self, prompt: int) -> torch.Tensor:
        """(R, P, V): every row at once (small models, tests)."""
        return torch.stack(list(self.rows(prompt)))


@dataclass
class LogitRun:
    """One forward over B prompts (each read at `positions[b]`)."""

    model: str  # how outputs name the model
    tokens: list[list[str]]  # each prompt's token names
    positions: list[int]  # each prompt's chosen position (DLA)
    parts: ResidualParts  # the residual at those positions
    norm: FrozenNorm  # the final norm, frozen at those rows
    logits: torch.Tensor  # (B, V) the model's own logits there (after its transform)
    unembed_weight: torch.Tensor  # (V, E) the unembedding (tied or not: the head's own)
    unembed_bias: torch.Tensor | None  # (V,)
    transform: LogitTransform
    norm_name: str  # the final norm module, for outputs
    lens: LensRows | None = None
    lens_positions: list[list[int]] | None = None
    notes: list[str] = field(default_factory=list)
    vocabulary: dict[int, str] = field(default_factory=dict)  # id -> name, where known
