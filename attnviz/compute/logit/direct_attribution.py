"""Direct logit attribution: each residual part's direct contribution to the metric, through the
final norm with its scale frozen at the run being decomposed, and the unembedding.

metric = u · head(norm(final)) + c, with u = W_U[answer] − W_U[wrong] (or W_U[answer] alone) and
c = b_U[answer] − b_U[wrong]. With the scale frozen, norm(final) = Σ_p linear(p) + bias, so
metric = Σ_p u · linear(p) + u · bias_norm + c: the parts, plus two constants, add up exactly.
A logit transform after the unembedding (a scale, Gemma-2's softcap) is applied to the whole;
a linear one scales every part, a softcap is nonlinear, so the attribution is then to the
logit before the softcap and the model's own metric is shown beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.compute.logit.frozen_norm import FrozenNorm
from attnviz.compute.logit.residual_parts_data import ResidualParts


@dataclass(frozen=True)
class Unembedding:
    """The rows of W_U the metric reads, per prompt, and the head's bias difference."""

    direction: torch.Tensor  # (B, E) W_U[answer] − W_U[wrong] (or W_U[answer])
    bias: torch.Tensor  # (B,) b_U[answer] − b_U[wrong] (zeros: no bias)
    factor: float = 1.0  # a linear logit transform after the head (Cohere's logit_scale)


@dataclass(frozen=True)
class Attribution:
    """Each part's direct contribution to the metric, per prompt (B,). Sum of parts = embed +
    Σ attn + Σ mlp + norm_bias + head_bias; heads split attn (Σ heads + attn_bias = attn)."""

    embed: torch.Tensor  # (B,)
    attn: torch.Tensor  # (N, B)
    mlp: torch.Tensor | None  # (N, B)
    heads: torch.Tensor | None  # (N, H, B)
    attn_bias: torch.Tensor | None  # (N, B)
    norm_bias: torch.Tensor  # (B,) the final norm's bias through the unembedding
    head_bias: torch.Tensor  # (B,) the unembedding's bias difference
    scale: torch.Tensor  # (B,) the final norm's frozen 1/σ
    target: torch.Tensor  # (B,) what the parts must add up to: the model's own metric
    # (before a softcap: the model's own logits, un-softcapped)
    cross: torch.Tensor | None = None  # (N, B) an encoder-decoder's cross-attention
    cross_heads: torch.Tensor | None = None  # (N, H, B)
    cross_bias: torch.Tensor | None = None  # (N, B)

    @property
    def total(self) -> torch.Tensor:
        """(B,) the sum of the parts."""
        total = self.embed + self.attn.sum(0) + self.norm_bias + self.head_bias
        if self.cross is not None:
            total = total + self.cross.sum(0)
        return total if self.mlp is None else total + self.mlp.sum(0)

    @property
    def remainder(self) -> torch.Tensor:
        """(B,) the model's own metric − the sum of the parts (float round-off only)."""
        return self.target - self.total


def attribute(parts: ResidualParts, norm: FrozenNorm, unembed: Unembedding,
              target: torch.Tensor) -> Attribution:
    """Every part's u · linear(part), in float64; `target` (B,) the model's own metric."""
    u = unembed.direction.double() * unembed.factor  # (B, E)

    def through(vectors: torch.Tensor) -> torch.Tensor:  # (..., B, E) -> (..., B)
        return (norm.linear(vectors.double()) * u).sum(-1)

    def maybe(vectors: torch.Tensor | None) -> torch.Tensor | None:
        return None if vectors is None else through(vectors)

    width = parts.final.shape[-1]
    return Attribution(
        embed=through(parts.embed), attn=through(parts.attn), mlp=maybe(parts.mlp),
        heads=maybe(parts.heads), attn_bias=maybe(parts.attn_bias),
        norm_bias=(norm.constant(width).double() * u).sum(-1),
        head_bias=unembed.bias.double() * unembed.factor,
        scale=norm.scale.double(), target=target.double(), cross=maybe(parts.cross),
        cross_heads=maybe(parts.cross_heads), cross_bias=maybe(parts.cross_bias))

