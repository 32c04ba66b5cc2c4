"""What `attnviz circuits` found: each layer's heads' circuits and the composition grids between
layers. Plain data with its JSON form, computed by app.circuits and drawn by render."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnviz.compute.qkov.circuits import HeadCircuit

CONVENTIONS = ("weights as stored (out × in); W_QK = W_Qᵀ W_K (score x_iᵀ W_QK x_j), "
               "W_OV = W_O[:, head] W_V (what the head writes from x_j); grouped-query heads use "
               "their group's W_K, W_V; a norm's scale γ is folded into W_Q, W_K, W_V (no mean "
               "centering), biases are listed apart")
COPYING_LINE = ("copy: Σ Re λ / Σ |λ| over the eigenvalues of W_OV (those of the d × d "
                "W_V W_O[:, head]): +1 the head writes back what it reads (a copying head), "
                "−1 the opposite, near 0 neither")


@dataclass
class LayerCircuits:
    index: int  # as `attnviz inspect` numbers it
    name: str
    label: str  # as --layer names it: "1", "enc 0", "cross 1"
    stack: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    heads: list[HeadCircuit]
    norm: str | None  # which γ was folded in; None: none recognized
    positions: str
    out_bias_norm: float | None = None


@dataclass
class CompositionGrid:
    kind: str  # Q, K or V
    later: int  # index into CircuitsResult.layers
    earlier: int
    scores: list[list[float]]  # [later head][earlier head]
    baseline: list[list[float]]


@dataclass
class CircuitsResult:
    source: str
    layers: list[LayerCircuits]
    compositions: list[CompositionGrid]
    notes: list[str] = field(default_factory=list)
    composition_skipped: str | None = None

    def grids(self, kind: str) -> list[CompositionGrid]:
        return [g for g in self.compositions if g.kind == kind]

    def strongest(self, later: int, head: int) -> tuple[str, int, int, float, float] | None:
        """(kind, earlier layer, earlier head, score, baseline) of a head's strongest
        composition, by score over baseline; None when it has none."""
        best = None
        for g in self.compositions:
            if g.later != later:
                continue
            for j, score in enumerate(g.scores[head]):
                base = g.baseline[head][j]
                key = score / base if base > 0 else score
                if best is None or key > best[0]:
                    best = (key, (g.kind, g.earlier, j, score, base))
        return None if best is None else best[1]

    def to_json(self) -> dict[str, Any]:
        from attnviz.compute.qkov.circuits import EFFECTIVE_SHARE, RANK_RTOL

        heads = [{"layer": layer.index, "name": layer.name, "label": layer.label,
                  "head": c.head, "kv_head": c.kv_head, "qk": c.qk.to_json(),
                  "ov": {**c.ov.to_json(), "copying": c.copying}, "bias_norms": c.bias_norms}
                 for layer in self.layers for c in layer.heads]
        comp = [{"kind": g.kind, "later": [self.layers[g.later].index, i],
                 "earlier": [self.layers[g.earlier].index, j], "score": g.scores[i][j],
                 "baseline": g.baseline[i][j]}
                for g in self.compositions for i in range(len(g.scores))
                for j in range(len(g.scores[i]))]
        layers = [{"layer": layer.index, "name": layer.name, "label": layer.label,
                   "num_heads": layer.num_heads, "num_kv_heads": layer.num_kv_heads,
                   "head_dim": layer.head_dim, "norm_folded": layer.norm,
                   "positions": layer.positions, "out_bias_norm": layer.out_bias_norm}
                  for layer in self.layers]
        return {"source": self.source, "conventions": CONVENTIONS,
                "rank_rtol": RANK_RTOL, "effective_rank_share": EFFECTIVE_SHARE,
                "copying": COPYING_LINE, "layers": layers, "heads": heads,
                "composition": comp, "composition_skipped": self.composition_skipped,
                "notes": self.notes}
