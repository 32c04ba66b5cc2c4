"""A final norm with its scale frozen: LayerNorm or RMSNorm at the statistics of one run, which
makes it affine, so a sum of residual parts maps to the sum of their images.

Which kind a model's module is, and whether its gain is `weight` or `1 + weight` (Gemma), is not
guessed from its class: each candidate is applied to the run's own input and kept only when it
reproduces the module's own output.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from attnviz.errors import CheckFailed

USUAL_EPS = (1e-5, 1e-6, 1e-12)  # tried where a module keeps its epsilon in its code (OLMo)
FIT_TOLERANCE = 1e-4  # relative to the output's largest magnitude (float32 module, float64 here)


class NormKind(str, Enum):
    LAYER = "LayerNorm"  # (x − mean) / sqrt(var + eps) · w + b
    RMS = "RMSNorm"  # x / sqrt(mean(x²) + eps) · w
    RMS_OFFSET = "RMSNorm with gain 1 + weight"  # Gemma's
    LAYER_OFFSET = "LayerNorm with gain 1 + weight"  # Nemotron's LayerNorm1P


@dataclass(frozen=True)
class FrozenNorm:
    """y = gain ⊙ center(x) · scale + bias, scale (…,) frozen per row (1/σ of the run)."""

    kind: NormKind
    scale: torch.Tensor  # (...,) one per residual row
    gain: torch.Tensor | None  # (E,)
    bias: torch.Tensor | None  # (E,)

    def linear(self, part: torch.Tensor) -> torch.Tensor:
        """The image of one residual part (…, E) (rows as `scale`, or broadcast over a leading
        parts axis): centered for LayerNorm, times the frozen scale and the gain."""
        if self.kind in (NormKind.LAYER, NormKind.LAYER_OFFSET):
            part = part - part.mean(-1, keepdim=True)
        out = part * self.scale[..., None]
        return out if self.gain is None else out * self.gain

    def constant(self, width: int) -> torch.Tensor:
        """The norm's bias (zeros where it has none): the part no residual part writes."""
        if self.bias is None:
            return torch.zeros(width, dtype=self.scale.dtype, device=self.scale.device)
        return self.bias

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.constant(x.shape[-1])


def frozen_scale(kind: NormKind, x: torch.Tensor, eps: float) -> torch.Tensor:
    """1/σ of each row of x (…, E) as the norm computes it."""
    if kind in (NormKind.LAYER, NormKind.LAYER_OFFSET):
        return torch.rsqrt(x.var(-1, unbiased=False) + eps)
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


@dataclass(frozen=True)
class NormParams:
    """A norm module's parameters as stored (None: it has none)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float | None  # None: not stored on the module; the usual values are tried


def fit_norm(x: torch.Tensor, y: torch.Tensor, params: NormParams, what: str,
             tolerance: float = FIT_TOLERANCE) -> FrozenNorm:
    """The norm kind that maps the run's own input x (…, E) to the module's own output y, with
    its scale frozen at x; a module none reproduces is refused (attnviz would decompose
    something other than the model). `tolerance`: the module's dtype's round-off, relative."""
    x, y = x.double(), y.double()
    w = None if params.weight is None else params.weight.double()
    b = None if params.bias is None else params.bias.double()
    epsilons = [params.eps] if params.eps is not None else list(USUAL_EPS)
    candidates = [(NormKind.LAYER, w, b), (NormKind.RMS, w, b)]
    if w is not None:
        candidates += [(NormKind.RMS_OFFSET, 1.0 + w, b), (NormKind.LAYER_OFFSET, 1.0 + w, b)]
    bound = tolerance * max(1.0, float(y.abs().max()))
    best = float("inf")
    for eps in epsilons:
        for kind, gain, shift in candidates:
            norm = FrozenNorm(kind, frozen_scale(kind, x, eps), gain, shift)
            diff = float((norm.apply(x) - y).abs().max())
            if diff <= bound:
                return norm
            best = min(best, diff)
    raise CheckFailed(f"{what} is neither a LayerNorm nor an RMSNorm attnviz can reproduce "
                      f"(closest differs from the module's own output by {best:.2e})",
                      fix="report this model to attnviz")
