"""`attnviz circuits`: every head's QK and OV circuit, and Q-, K-, V-composition between the
heads of different layers, from the bundled model (default), a checkpoint, a Hugging Face folder
or a random nn.MultiheadAttention. Request in, result out; the math is compute/qkov/circuits.py."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.app.circuits_source import ChosenLayer, NormScale, norm_scale
from attnviz.compute.qkov.circuits_result import (  # noqa: F401 - the use case's result
    CONVENTIONS,
    COPYING_LINE,
    CircuitsResult,
    CompositionGrid,
    LayerCircuits,
)
from attnviz.core.request import HeadHints, RandomSpec
from attnviz.errors import CheckpointError, option, quoted

if TYPE_CHECKING:
    import torch

    from attnviz.compute.qkov.circuits import LayerFactors
    from attnviz.load.store import TensorStore

# composition keeps every chosen layer's weights (float32): on by default up to this many bytes
COMPOSITION_AUTO_BYTES = 1 << 30
LAYERS_AT_ONCE = 2  # layers computed at once, each on its own thread
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


def run_circuits(request: CircuitsRequest) -> CircuitsResult:
    """Circuits of the chosen layers (one at a time, each weight read once) and, where on,
    composition between every later and earlier layer of a stack."""
    from attnviz.app.circuits_source import check_heads, choose, open_source
    from attnviz.compute.forward_pass.device import resolve_device

    device = resolve_device(request.device)
    layers, store, _ = open_source(request.weights, request.model, request.random,
                                   request.hints)
    chosen = choose(layers, request.layer, store.source)
    check_heads(chosen)
    compose_on, skipped = _composition_wanted(request.composition, chosen)
    results, factors, notes = [], [], []
    for c, (layer_result, layer_factors) in zip(chosen, _each_layer(store, chosen, device,
                                                                    compose_on), strict=True):
        results.append(layer_result)
        if compose_on:  # the d × d factors (10 MB a layer at E = 4096) only for composition
            factors.append(layer_factors)
        notes += _layer_notes(store, c, norm_scale(store, c.layer))
    grids: list[CompositionGrid] = []
    if compose_on:
        grids, apart = _compose_all(chosen, factors)
        notes += apart
        if not grids and apart:
            skipped = "not composable: the layers' widths differ (see the notes)"
    notes += _position_notes(chosen)
    return CircuitsResult(store.source, results, grids, notes, skipped)


def _each_layer(store: TensorStore, chosen: list[ChosenLayer], device: torch.device,
                keep: bool) -> Iterator[tuple[LayerCircuits, LayerFactors]]:
    """Each chosen layer's circuits, in order; two layers at once on two threads where the CPU
    has two cores or more, each with half of them per operation (so never more than two
    layers' weights are held). One thread per operation on two cores: between the many small
    products of a layer, torch's idle threads spin, and on a busy machine that spinning cost
    more CPU time than the second thread gave."""
    import os
    from concurrent.futures import Future, ThreadPoolExecutor

    from attnviz.compute.qkov.circuits_factors import op_threads

    def one(c: ChosenLayer) -> tuple[LayerCircuits, LayerFactors]:
        return _one_layer(store, c, norm_scale(store, c.layer), device, keep)

    cores = os.cpu_count() or 1
    if cores < 2 or len(chosen) < 2:
        yield from map(one, chosen)
        return
    with op_threads(cores // 2), ThreadPoolExecutor(LAYERS_AT_ONCE) as pool:
        pending: deque[Future[tuple[LayerCircuits, LayerFactors]]] = deque()
        for c in chosen:
            if len(pending) == LAYERS_AT_ONCE:
                yield pending.popleft().result()
            pending.append(pool.submit(one, c))
        while pending:
            yield pending.popleft().result()


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
                       f"{option('layer')}, or ask for it with {option('composition')}")
    return True, None


def _one_layer(store: TensorStore, c: ChosenLayer, gamma: NormScale | None,
               device: torch.device, keep: bool) -> tuple[LayerCircuits, LayerFactors]:

    from attnviz.compute.forward_pass.forward import read_ref
    from attnviz.compute.qkov.circuits import layer_circuits
    from attnviz.compute.qkov.circuits_factors import StoredWeight

    layer = c.layer
    scale = None
    if gamma is not None:
        scale = finite(store.read(gamma.key), gamma.key, "γ", c, store).float() + gamma.offset
    refs = {"q": layer.q_weight, "k": layer.k_weight, "v": layer.v_weight, "o": layer.o_weight}

    def read(name: str) -> StoredWeight:
        """As stored (refused if not finite, before any algebra on it); γ folded into W_Q, and
        into W_K, W_V but for cross-attention's."""
        folds = name == "q" or (name in "kv" and c.stack != "cross")
        W = finite(read_ref(store, refs[name]), refs[name].key, f"W_{name.upper()}", c, store)
        return StoredWeight(W, scale if folds else None)

    biases = {name: finite(read_ref(store, ref), ref.key, f"b_{name.upper()}", c, store).double()
              if ref is not None else None
              for name, ref in (("q", layer.q_bias), ("k", layer.k_bias), ("v", layer.v_bias))}
    assert layer.num_heads is not None and layer.num_kv_heads is not None
    assert layer.head_dim is not None
    factors, heads = layer_circuits(read, (layer.num_heads, layer.num_kv_heads, layer.head_dim),
                                    biases, keep, device)
    out_bias = None
    if layer.o_bias is not None:
        b_o = finite(read_ref(store, layer.o_bias), layer.o_bias.key, "b_O", c, store)
        out_bias = float(b_o.double().norm())
    return LayerCircuits(c.index, layer.name, c.label, c.stack, layer.num_heads,
                         layer.num_kv_heads, layer.head_dim, heads,
                         None if gamma is None else gamma.describe(), layer.positions,
                         out_bias), factors


def finite(tensor: torch.Tensor, key: str, role: str, c: ChosenLayer,
           store: TensorStore) -> torch.Tensor:
    """`tensor`, refused when it holds NaN or Inf: a non-finite weight made the linear algebra
    fail inside LAPACK (or print NaN) instead of naming the tensor."""
    import math

    import torch

    from attnviz.compute.qkov.circuits_factors import StoredWeight, peak

    if not math.isfinite(peak(StoredWeight(tensor))):  # a pass without a full-size copy
        values = tensor.float()  # only here, to count (float8 has no isnan kernel on a CPU)
        bad = ~torch.isfinite(values)
        nan = int(torch.isnan(values).sum())
        counts = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"),
                                                          (int(bad.sum()) - nan, "Inf")) if n)
        raise CheckpointError(f"tensor {quoted(key)} ({role} of layer {quoted(c.label)}) holds "
                              f"non-finite values ({counts}): circuits need finite weights",
                              fix="repair or re-export the checkpoint ('attnviz inspect' counts "
                              "non-finite values per tensor)", where=store.source)
    return tensor


def _compose_all(chosen: list[ChosenLayer], factors: list[LayerFactors],
                 ) -> tuple[list[CompositionGrid], list[str]]:
    """Every later layer on every earlier one of the same residual stream: all three kinds for
    self-attention, Q only for cross-attention (its keys and values read the encoder). A kind
    whose later layer reads vectors of another width than the earlier one writes (Swin's
    stages, a kdim ≠ E) is left out, with one note per pair of widths."""
    from attnviz.compute.qkov.circuits import KINDS, composable, compose, not_composable

    grids = []
    apart: dict[str, dict[str, list[str]]] = {}  # why → {"layer 1 on layer 0": kinds}
    order = sorted(range(len(chosen)), key=lambda i: (chosen[i].residual, chosen[i].order))
    for pos, b in enumerate(order):
        for a in order[:pos]:
            if chosen[a].residual != chosen[b].residual or chosen[a].order == chosen[b].order:
                continue
            kinds = ("Q",) if chosen[b].stack == "cross" else KINDS
            fit = tuple(k for k in kinds if composable(k, factors[b], factors[a]))
            for kind in kinds:
                if kind not in fit:
                    pair = f"layer {chosen[b].label} on layer {chosen[a].label}"
                    why = not_composable(kind, factors[b], factors[a])
                    apart.setdefault(why, {}).setdefault(pair, []).append(kind)
            for comp in compose(factors[b], factors[a], fit) if fit else []:
                grids.append(CompositionGrid(comp.kind, b, a, comp.scores.tolist(),
                                             comp.baseline.tolist()))
    notes = []
    for why, pairs in apart.items():
        (first, kinds_left_out), more = next(iter(pairs.items())), len(pairs) - 1
        notes.append(f"{', '.join(kinds_left_out)}-composition of {first}"
                     + (f" and of {more} more layer pair{'s' * (more > 1)}" if more else "")
                     + f": {why} (every per-head number is still computed)")
    return grids, notes


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
