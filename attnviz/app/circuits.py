"""`attnviz circuits`: every head's QK and OV circuit, and Q-, K-, V-composition between the
heads of different layers, from the bundled model (default), a checkpoint, a Hugging Face folder
or a random nn.MultiheadAttention. Request in, result out; the math is compute/circuits.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.app.circuits_source import ChosenLayer, NormScale, norm_scale
from attnviz.recognize.base import HeadHints
from attnviz.sources.layers import RandomSpec

if TYPE_CHECKING:
    import torch

    from attnviz.compute.circuits import HeadCircuit, LayerFactors
    from attnviz.load.checkpoint import TensorStore

# composition keeps every chosen layer's weights (float32): on by default up to this many bytes
COMPOSITION_AUTO_BYTES = 1 << 30
CONVENTIONS = ("weights as stored (out × in); W_QK = W_Qᵀ W_K (score x_iᵀ W_QK x_j), "
               "W_OV = W_O[:, head] W_V (what the head writes from x_j); grouped-query heads use "
               "their group's W_K, W_V; a norm's scale γ is folded into W_Q, W_K, W_V (no mean "
               "centering), biases are listed apart")
COPYING_LINE = ("copy: Σ Re λ / Σ |λ| over the eigenvalues of W_OV (those of the d × d "
                "W_V W_O[:, head]): +1 the head writes back what it reads (a copying head), "
                "−1 the opposite, near 0 neither")


@dataclass(frozen=True)
class CircuitsRequest:
    """Exactly one source: the bundled model (nothing given), `weights`, `model` or `random`."""

    weights: Path | None = None
    model: str | None = None
    layer: str | None = None  # all (default), N, -1, A:B, 'enc N', 'dec N', 'cross N', a name
    hints: HeadHints = HeadHints()
    random: RandomSpec | None = None
    composition: bool | None = None  # None: when the chosen layers' weights fit in 1 GiB
    device: str = "cpu"


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
        from attnviz.compute.circuits import EFFECTIVE_SHARE, RANK_RTOL

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


def run_circuits(request: CircuitsRequest) -> CircuitsResult:
    """Circuits of the chosen layers (one at a time, each weight read once) and, where on,
    composition between every later and earlier layer of a stack."""
    from attnviz.app.circuits_source import check_heads, choose, open_source
    from attnviz.compute.device import resolve_device

    device = resolve_device(request.device)
    layers, store, _ = open_source(request.weights, request.model, request.random,
                                   request.hints)
    chosen = choose(layers, request.layer, store.source)
    check_heads(chosen)
    compose_on, skipped = _composition_wanted(request.composition, chosen)
    results, factors, notes = [], [], []
    for c in chosen:
        gamma = norm_scale(store, c.layer)
        layer_result, layer_factors = _one_layer(store, c, gamma, device, compose_on)
        results.append(layer_result)
        if compose_on:  # the d × d factors (10 MB a layer at E = 4096) only for composition
            factors.append(layer_factors)
        notes += _layer_notes(store, c, gamma)
    grids = _compose_all(chosen, factors) if compose_on else []
    notes += _position_notes(chosen)
    return CircuitsResult(store.source, results, grids, notes, skipped)


def _composition_wanted(asked: bool | None, chosen: list[ChosenLayer]) -> tuple[bool, str | None]:
    if asked is False:
        return False, "not asked for"
    stacks = [c.residual for c in chosen]
    if all(stacks.count(s) < 2 for s in set(stacks)):
        return False, "needs two layers of one stack"
    size = sum(4 * (2 * ref.numel) for c in chosen
               for ref in (c.layer.q_weight, c.layer.o_weight))
    if asked is None and size > COMPOSITION_AUTO_BYTES:
        return False, (f"the {len(chosen)} layers' weights ({size / 2**30:.1f} GiB as float32) "
                       f"are more than composition holds by default: choose fewer with "
                       f"‹layer›, or ask for it with ‹composition›")
    return True, None


def _one_layer(store: TensorStore, c: ChosenLayer, gamma: NormScale | None,
               device: torch.device, keep: bool) -> tuple[LayerCircuits, LayerFactors]:
    import torch

    from attnviz.compute.circuits import fold_scale, layer_circuits
    from attnviz.compute.forward import read_ref

    layer = c.layer
    scale = None
    if gamma is not None:
        scale = store.read(gamma.key).float().to(device) + gamma.offset
    refs = {"q": layer.q_weight, "k": layer.k_weight, "v": layer.v_weight, "o": layer.o_weight}

    def read(name: str) -> torch.Tensor:
        W = read_ref(store, refs[name]).to(device=device, dtype=torch.float32)
        folds = name == "q" or (name in "kv" and c.stack != "cross")
        return fold_scale(W, scale) if folds and scale is not None else W

    biases = {name: read_ref(store, ref).double() if ref is not None else None
              for name, ref in (("q", layer.q_bias), ("k", layer.k_bias), ("v", layer.v_bias))}
    assert layer.num_heads is not None and layer.num_kv_heads is not None
    assert layer.head_dim is not None
    factors, heads = layer_circuits(read, (layer.num_heads, layer.num_kv_heads, layer.head_dim),
                                    biases, keep)
    out_bias = None
    if layer.o_bias is not None:
        out_bias = float(read_ref(store, layer.o_bias).double().norm())
    return LayerCircuits(c.index, layer.name, c.label, c.stack, layer.num_heads,
                         layer.num_kv_heads, layer.head_dim, heads,
                         None if gamma is None else gamma.describe(), layer.positions,
                         out_bias), factors


def _compose_all(chosen: list[ChosenLayer], factors: list[LayerFactors]) -> list[CompositionGrid]:
    """Every later layer on every earlier one of the same residual stream: all three kinds for
    self-attention, Q only for cross-attention (its keys and values read the encoder)."""
    from attnviz.compute.circuits import KINDS, compose

    grids = []
    order = sorted(range(len(chosen)), key=lambda i: (chosen[i].residual, chosen[i].order))
    for pos, b in enumerate(order):
        for a in order[:pos]:
            if chosen[a].residual != chosen[b].residual or chosen[a].order == chosen[b].order:
                continue
            kinds = ("Q",) if chosen[b].stack == "cross" else KINDS
            for comp in compose(factors[b], factors[a], kinds):
                grids.append(CompositionGrid(comp.kind, b, a, comp.scores.tolist(),
                                             comp.baseline.tolist()))
    return grids


def _layer_notes(store: TensorStore, c: ChosenLayer, gamma: NormScale | None) -> list[str]:
    notes = []
    name = c.layer.name or "the layer"
    if gamma is None:
        notes.append(f"{name}: no norm scale recognized beside it: weights not folded (none "
                     "feeds a post-norm model's attention)")
    if c.stack == "cross":
        notes.append(f"{name}: cross-attention: W_K, W_V read the encoder's output (its final "
                     "norm not folded); only its Q-composition with decoder heads is computed")
    prefix = c.layer.name + "." if c.layer.name else ""
    if any(prefix + key in store for key in ("q_norm.weight", "q_layernorm.weight")):
        notes.append(f"{name}: a norm on each head's q and k sits between the projections and "
                     "the scores: W_QK is the circuit before it")
    return notes


def _position_notes(chosen: list[ChosenLayer]) -> list[str]:
    kinds = sorted({c.layer.positions.split()[0] for c in chosen if c.layer.positions}
                   & {"rope", "alibi", "relative"})
    if not kinds:
        return []
    shown = {"rope": "RoPE", "alibi": "ALiBi", "relative": "relative position bias"}
    return [f"position terms ({', '.join(shown[k] for k in kinds)}) enter the scores apart "
            "from the weights: they are not part of W_QK"]
