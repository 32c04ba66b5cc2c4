"""What a source hands to `attribute` and `lens`: one forward over B prompts, read at each
prompt's chosen position, with everything needed to decompose it — no model object, tensors
only, so the arithmetic is the same for the bundled model and a Hugging Face model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnviz.compute.logit.frozen_norm import FrozenNorm
from attnviz.compute.logit.residual_parts_data import ResidualParts


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
    lens: list[torch.Tensor] | None = None  # per prompt (R, P, V) each row's logits
    lens_positions: list[list[int]] | None = None
    notes: list[str] = field(default_factory=list)
    vocabulary: dict[int, str] = field(default_factory=dict)  # id -> name, where known
