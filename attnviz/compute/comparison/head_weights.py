"""Two models' attention weights compared head by head, one tensor at a time.

Each query head h owns rows h·d:(h+1)·d of W_q and b_q and columns h·d:(h+1)·d of W_o; its
key/value head g = h // (H / H_kv) owns rows g·d:(g+1)·d of W_k, W_v, b_k, b_v and nn.MHA's
bias_k/bias_v (the slices `attnviz split` shows, `attnviz.core.layer`). b_o is added after the
heads are summed, so it belongs to the layer, not to a head.

For every slice two facts: whether its stored bytes are identical in both models (same dtype,
same bytes: published checkpoint series have shipped one model's weights under two names,
pythia #205), and Σ(B − A)² and ΣA² in float64, from which a head's relative distance
‖B − A‖ / ‖A‖ follows for any grouping of slices (a projection, the whole head).

Memory: a layer's tensors are read role by role (W_q of A, W_q of B, then W_k, ...), and each
is dropped before the next is read, so at most one stored tensor of each model is held."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnviz.compute.forward_pass.forward import read_ref, refuse_non_finite
from attnviz.core.layer import AttentionLayer
from attnviz.errors import UsageError, option, quoted
from attnviz.load.store import TensorStore

PROJECTIONS = ("q", "k", "v", "o")


@dataclass(frozen=True)
class Role:
    """One tensor of a layer and how the heads share it."""

    field: str  # AttentionLayer's attribute holding its TensorRef
    name: str  # as reports name it
    projection: str  # q, k, v or o
    owner: str  # "query": rows of query head h; "kv": rows of kv head g; "columns": W_o's
    # columns of query head h; "layer": the whole tensor, no head's own


# The layout knowledge as data: each tensor, the projection it belongs to, who owns which part.
ROLES = (
    Role("q_weight", "W_q", "q", "query"), Role("q_bias", "b_q", "q", "query"),
    Role("k_weight", "W_k", "k", "kv"), Role("k_bias", "b_k", "k", "kv"),
    Role("bias_k", "bias_k", "k", "kv"),
    Role("v_weight", "W_v", "v", "kv"), Role("v_bias", "b_v", "v", "kv"),
    Role("bias_v", "bias_v", "v", "kv"),
    Role("o_weight", "W_o", "o", "columns"), Role("o_bias", "b_o", "o", "layer"),
)  # fmt: skip


@dataclass(frozen=True)
class PartDiff:
    """One slice (a head's rows of W_q, say) in both models."""

    identical: bool  # same dtype, shape and stored bytes
    diff_sq: float  # Σ (B − A)², float64
    base_sq: float  # Σ A², float64

    @property
    def distance(self) -> float:
        """‖B − A‖ / ‖A‖ (0 for identical values; inf when A is all zeros and B is not)."""
        return relative_distance(self.diff_sq, self.base_sq)


def relative_distance(diff_sq: float, base_sq: float) -> float:
    if diff_sq == 0.0:
        return 0.0
    return math.sqrt(diff_sq / base_sq) if base_sq > 0.0 else math.inf


def combine(parts: Sequence[PartDiff]) -> PartDiff:
    """Several slices taken as one vector: identical when each is, squared sums added."""
    return PartDiff(all(p.identical for p in parts), sum(p.diff_sq for p in parts),
                    sum(p.base_sq for p in parts))


@dataclass(frozen=True)
class HeadDiff:
    """One query head: its own slices and those of the key/value head it attends with."""

    layer: int  # index in the inventory, as `attnviz inspect` numbers it
    head: int
    kv_head: int
    parts: dict[str, PartDiff]  # by Role.name: W_q, b_q, W_k, ..., W_o (those the layer has)

    @property
    def total(self) -> PartDiff:
        return combine(list(self.parts.values()))

    @property
    def identical(self) -> bool:
        return self.total.identical

    @property
    def distance(self) -> float:
        return self.total.distance

    def projection(self, name: str) -> PartDiff:
        """W_q and b_q together for "q" (W_k, b_k, bias_k for "k"; ...; W_o for "o")."""
        return combine([self.parts[r.name] for r in ROLES
                        if r.projection == name and r.name in self.parts])


@dataclass(frozen=True)
class LayerDiff:
    index: int
    name_a: str
    name_b: str
    heads: list[HeadDiff]
    shared: dict[str, PartDiff]  # tensors no head owns (b_o)


@dataclass
class WeightComparison:
    """Every head of two models with the same head geometry, compared."""

    layers: list[LayerDiff]
    dtypes: tuple[str, str]  # the attention tensors' stored dtypes ("F32", or "F32, BF16")
    notes: list[str] = field(default_factory=list)

    @property
    def heads(self) -> list[HeadDiff]:
        return [h for layer in self.layers for h in layer.heads]

    @property
    def identical_heads(self) -> list[HeadDiff]:
        return [h for h in self.heads if h.identical]

    @property
    def all_identical(self) -> bool:
        """Every head and every shared tensor byte-identical: the same attention weights."""
        return all(h.identical for h in self.heads) and all(
            p.identical for layer in self.layers for p in layer.shared.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "dtypes": list(self.dtypes),
            "heads": len(self.heads),
            "identical_heads": len(self.identical_heads),
            "all_identical": self.all_identical,
            "layers": [{
                "index": layer.index, "name": layer.name_a,
                **({"name_against": layer.name_b} if layer.name_b != layer.name_a else {}),
                "shared": {name: _part_json(p) for name, p in layer.shared.items()},
                "heads": [{"head": h.head, "kv_head": h.kv_head, "identical": h.identical,
                           "distance": h.distance,
                           "projections": {name: _part_json(h.projection(name))
                                           for name in PROJECTIONS}}
                          for h in layer.heads],
            } for layer in self.layers],
            "notes": list(self.notes),
        }


def _part_json(part: PartDiff) -> dict[str, Any]:
    return {"identical": part.identical, "distance": part.distance}


# ---------------------------------------------------------------------------------------------
# geometry


def geometry(layer: AttentionLayer) -> dict[str, object]:
    """What must match for two layers' heads to be compared one to one."""
    return {"heads": layer.num_heads, "key/value heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "embed_dim": layer.embed_dim,
            "key input width": layer.kdim, "value input width": layer.vdim,
            "biases": tuple(r.name for r in ROLES if getattr(layer, r.field) is not None)}


def check_same_geometry(layers_a: Sequence[AttentionLayer], layers_b: Sequence[AttentionLayer],
                        sides: tuple[str, str]) -> None:
    """Refuse two inventories whose heads do not pair one to one, naming the first difference.
    `sides` names the two sources in messages (neutral option references)."""
    a_name, b_name = sides
    fix = ("compare two models of one architecture and size (a base model and its fine-tune, "
           "two checkpoints of one training run)")
    if len(layers_a) != len(layers_b):
        raise UsageError(f"{a_name} has {len(layers_a)} attention layers, {b_name} "
                         f"{len(layers_b)}: their heads do not pair one to one", fix=fix)
    for index, (la, lb) in enumerate(zip(layers_a, layers_b, strict=True)):
        for layer in (la, lb):
            if not layer.heads_known:
                raise UsageError(f"the number of heads of layer {quoted(layer.name)} is unknown",
                                 fix=f"pass {option('num_heads')} (and {option('num_kv_heads')} "
                                 "for grouped-query layers)", option="num_heads")
        ga, gb = geometry(la), geometry(lb)
        for what in ga:
            if ga[what] != gb[what]:
                shown_a, shown_b = (_shown(g[what]) for g in (ga, gb))
                raise UsageError(f"layer {index} ({quoted(la.name)}) differs in {what}: "
                                 f"{shown_a} in {a_name}, {shown_b} in {b_name}; their heads do "
                                 "not pair one to one", fix=fix)


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + (", ".join(map(str, value)) or "none") + ")"
    return str(value)


# ---------------------------------------------------------------------------------------------
# comparison


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The two tensors store the same bytes: same dtype and shape, bit for bit (so NaN equals
    a NaN of the same bits and 0.0 differs from -0.0, unlike ==)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def part_diff(a: torch.Tensor, b: torch.Tensor) -> PartDiff:
    """One slice in both models, squared sums in float64."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return PartDiff(same_bytes(a, b), float(((b64 - a64) ** 2).sum()), float((a64 ** 2).sum()))


Reader = Callable[[AttentionLayer, Role], "torch.Tensor | None"]


def compare_layer(index: int, la: AttentionLayer, read_a: Reader, lb: AttentionLayer,
                  read_b: Reader) -> LayerDiff:
    """One layer's heads, reading its tensors role by role (one of each model at a time)."""
    H, group = la.num_heads, la.group_size
    assert H is not None
    parts: list[dict[str, PartDiff]] = [{} for _ in range(H)]
    shared: dict[str, PartDiff] = {}
    for role in ROLES:
        a = read_a(la, role)
        if a is None:
            continue
        b = read_b(lb, role)
        assert b is not None  # check_same_geometry compared which biases each layer has
        if role.owner == "layer":
            shared[role.name] = part_diff(a, b)
            continue
        for h in range(H):
            if role.owner == "kv":
                start, stop = la.kv_rows(h // group)
            else:
                start, stop = la.q_rows(h)
            if role.owner == "columns":  # W_o (E, H·d): the head's columns
                parts[h][role.name] = part_diff(a[:, start:stop], b[:, start:stop])
            else:
                parts[h][role.name] = part_diff(a[start:stop], b[start:stop])
        del a, b  # before the next role's tensors are read
    heads = [HeadDiff(index, h, h // group, parts[h]) for h in range(H)]
    return LayerDiff(index, la.name, lb.name, heads, shared)


def tensor_reader(store: TensorStore) -> Reader:
    """A role's tensor of a layer, as stored (its dtype), in (out, in) orientation; None when
    the layer has no such tensor. NaN or Inf is refused by name: a distance would be NaN."""

    def read(layer: AttentionLayer, role: Role) -> torch.Tensor | None:
        ref = getattr(layer, role.field)
        if ref is None:
            return None
        tensor = read_ref(store, ref)
        refuse_non_finite(tensor, ref.key, f"{role.name} of layer {quoted(layer.name)}",
                          store.source)
        return tensor

    return read


def compare_weights(layers_a: Sequence[AttentionLayer], store_a: TensorStore,
                    layers_b: Sequence[AttentionLayer], store_b: TensorStore,
                    sides: tuple[str, str]) -> WeightComparison:
    """Every head of two models with one head geometry (refused otherwise, naming what
    differs), layers paired by their position in the inventory."""
    check_same_geometry(layers_a, layers_b, sides)
    read_a, read_b = tensor_reader(store_a), tensor_reader(store_b)
    layers = [compare_layer(i, la, read_a, lb, read_b)
              for i, (la, lb) in enumerate(zip(layers_a, layers_b, strict=True))]
    dtypes = tuple(_dtypes(layers_x) for layers_x in (layers_a, layers_b))
    notes = []
    if dtypes[0] != dtypes[1]:
        notes.append(f"the weights are stored as {dtypes[0]} in {sides[0]} and {dtypes[1]} in "
                     f"{sides[1]}: no head can be byte-identical; the distances compare values")
    renamed = [(la.name, lb.name) for la, lb in zip(layers_a, layers_b, strict=True)
               if la.name != lb.name]
    if renamed:
        notes.append(f"{len(renamed)} layers are named differently in the two models "
                     f"(first: {quoted(renamed[0][0])} and {quoted(renamed[0][1])}); layers "
                     "are paired by position")
    return WeightComparison(layers, (dtypes[0], dtypes[1]), notes)


def _dtypes(layers: Sequence[AttentionLayer]) -> str:
    found = sorted({getattr(layer, r.field).dtype for layer in layers for r in ROLES
                    if getattr(layer, r.field) is not None})
    return ", ".join(found)
