"""The residual stream at one position, as the model's own modules wrote it: what a source
hands to direct logit attribution.

Shapes: B prompts, N layers, H heads, E the residual width. Every vector is the part's
contribution to the residual row that enters the final norm, at each prompt's chosen position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnviz.errors import CheckFailed

# A sum of parts differs from the model's own residual by float32 round-off only; a post-norm
# model, or a branch attnviz did not hook, differs by far more.
RESIDUAL_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ResidualParts:
    """embed + Σ_l (attn_l + cross_l + mlp_l) = final; attn_l = Σ_h heads[l, h] +
    attn_bias[l], cross_l likewise (an encoder-decoder's decoder: attention over the
    encoder's output)."""

    embed: torch.Tensor  # (B, E) what enters layer 0 (token, position, scaling)
    attn: torch.Tensor  # (N, B, E) each layer's attention output as added to the residual
    mlp: torch.Tensor | None  # (N, B, E) each layer's MLP output; None: attention-only model
    heads: torch.Tensor | None  # (N, H, B, E) each head's share of attn (its W_O columns)
    attn_bias: torch.Tensor | None  # (N, B, E) the output projection's bias (zeros: none)
    final: torch.Tensor  # (B, E) the model's own input to the final norm
    notes: list[str] = field(default_factory=list)
    cross: torch.Tensor | None = None  # (N, B, E) each decoder layer's cross-attention output
    cross_heads: torch.Tensor | None = None  # (N, H, B, E)
    cross_bias: torch.Tensor | None = None  # (N, B, E)

    @property
    def layers(self) -> int:
        return int(self.attn.shape[0])

    def summed(self) -> torch.Tensor:
        """(B, E) embed + every layer's attention (and cross-attention) and MLP output."""
        total = self.embed + self.attn.sum(0)
        if self.cross is not None:
            total = total + self.cross.sum(0)
        return total if self.mlp is None else total + self.mlp.sum(0)


def residual_gap(parts: ResidualParts) -> float:
    """max |final − Σ parts|, relative to the residual's largest magnitude."""
    scale = max(1.0, float(parts.final.abs().max()))
    return float((parts.final - parts.summed()).abs().max()) / scale


def head_gap(parts: ResidualParts) -> float:
    """max |attn − (Σ heads + bias)| over layers (and the same for cross-attention), relative
    to the output's largest magnitude."""
    gaps = [0.0]
    for out, heads, bias in ((parts.attn, parts.heads, parts.attn_bias),
                             (parts.cross, parts.cross_heads, parts.cross_bias)):
        if out is None or heads is None:
            continue
        shift = 0.0 if bias is None else bias
        scale = max(1.0, float(out.abs().max()))
        gaps.append(float((out - (heads.sum(1) + shift)).abs().max()) / scale)
    return max(gaps)


def check_parts(parts: ResidualParts, model: str,
                tolerance: float = RESIDUAL_TOLERANCE) -> None:
    """Refuse parts that do not add up to the model's own residual: DLA of a model whose
    residual is not a sum of its modules' outputs (post-norm: each layer normalizes the sum)
    would not be a sum of parts. `tolerance`: the model's dtype's round-off, relative."""
    gap = residual_gap(parts)
    if gap > tolerance:
        raise CheckFailed(
            f"{model}'s residual stream is not the sum of its embeddings and its layers' "
            f"attention and MLP outputs (relative gap {gap:.1e}): a post-norm model (or a "
            "branch attnviz does not see) normalizes the sum inside each layer, so no direct "
            "attribution adds up there", fix="use a pre-norm decoder (GPT-2, LLaMA, NeoX, ...)")
    gap = head_gap(parts)
    if gap > tolerance:
        raise CheckFailed(f"{model}'s heads (each one's W_O columns) do not add up to its "
                          f"attention output (relative gap {gap:.1e})",
                          fix="report this model to attnviz")
