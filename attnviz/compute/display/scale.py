"""The colour scale of attention maps, one for the terminal and the figures (`--scale`).

- max (the default): 0 to the largest weight shown, linear; one scale for every panel of a run,
  so heads compare, and a map of small weights (a long sentence) is not all dark;
- fixed: 0 to 1, linear; runs compare with each other;
- log: 10^-3 × the largest weight shown to the largest, logarithmic (smaller weights get the
  lowest colour); faint structure shows.

Masked cells (weight exactly 0: causal or padding) are never on the scale: renderers draw them
apart (`·` in the terminal, grey in figures).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from attnviz.core.choices import ColorScale

SCALES = ColorScale.values()
DEFAULT_SCALE = "max"
LOG_DECADES = 3  # --scale log spans 10^-3 of the largest weight to the largest


@dataclass(frozen=True)
class Scale:
    kind: str  # one of SCALES
    vmin: float  # the weight at the bottom of the scale (0 for the linear scales)
    vmax: float  # the weight at the top

    @property
    def log(self) -> bool:
        return self.kind == "log"

    def position(self, weight: float) -> float:
        """Where a weight sits on the scale, clipped to [0, 1]."""
        if self.log:
            if weight <= self.vmin:
                return 0.0
            t = math.log(weight / self.vmin) / math.log(self.vmax / self.vmin)
        else:
            t = (weight - self.vmin) / (self.vmax - self.vmin)
        return min(max(t, 0.0), 1.0)

    def weight_at(self, position: float) -> float:
        """The weight at a position in [0, 1] of the scale (the inverse of `position`)."""
        if self.log:
            return self.vmin * (self.vmax / self.vmin) ** position
        return self.vmin + (self.vmax - self.vmin) * position

    def describe(self) -> str:
        top = f"{self.vmax:.3g}"
        if self.kind == "fixed":
            return "scale fixed: 0 to 1"
        if self.log:
            return (f"scale log: {self.vmin:.2g} to {top}, the largest weight shown "
                    f"({LOG_DECADES} decades)")
        return f"scale max: 0 to {top}, the largest weight shown"


def map_scale(kind: str, maps: Iterable[Any]) -> Scale:
    """The scale of a set of displayed maps (numpy arrays of weights); `kind` is one of SCALES,
    parsed where the CLI and the API take it (attnviz.core.choices)."""
    if kind == "fixed":
        return Scale(kind, 0.0, 1.0)
    top = max((float(m.max()) for m in maps if m.size), default=0.0)
    top = top if top > 0.0 and math.isfinite(top) else 1.0
    if kind == "log":
        return Scale(kind, top * 10.0**-LOG_DECADES, top)
    return Scale(kind, 0.0, top)
