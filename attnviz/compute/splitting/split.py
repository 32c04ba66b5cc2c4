"""How the heads split W_q, W_k, W_v (by rows) and W_o (by columns), and the numerical proof.

Everything here is computed from an AttentionLayer and its weights; renderers only display it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from attnviz.core.layer import AttentionLayer
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import CheckFailed, UsageError, option

# The proof passes when max |Δ| <= PROOF_TOLERANCE × max(1, max |reference|), for the output and
# for the weights alike: float32 accumulates ~1e-6 relative error over a few hundred products.
PROOF_TOLERANCE = 1e-4


@dataclass(frozen=True)
class HeadSlice:
    head: int  # query head for q/o; key/value head for k/v
    start: int  # on the split axis
    stop: int
    shape: tuple[int, int]  # (out, in) shape of the slice
    stored_at: str  # where the slice lives in the checkpoint, e.g. "in_proj_weight[8:16]"
    query_heads: tuple[int, ...] = ()  # k/v under GQA: the query heads that share this slice


@dataclass(frozen=True)
class ProjectionSplit:
    name: str  # "q", "k", "v" or "o"
    shape: tuple[int, int]  # (out, in)
    split: str  # "rows" or "columns"
    stored_at: str  # the whole projection in the checkpoint, e.g. "in_proj_weight[0:64]"
    heads: list[HeadSlice]


@dataclass(frozen=True)
class Proof:
    """torch's own forward (or SDPA) against the per-head recomputation from slices."""

    reference: str  # what computed the reference
    output_diff: float  # max |out_ref - out_heads|
    weights_diff: float  # max |attn_ref - attn_heads| over all heads
    tolerance: float  # relative to max(1, max |reference output|)
    output_scale: float  # max(1, max |reference output|)
    batch: int
    length: int
    seed: int

    @property
    def max_abs_diff(self) -> float:
        return max(self.output_diff, self.weights_diff)

    @property
    def passed(self) -> bool:
        return (self.output_diff <= self.tolerance * self.output_scale
                and self.weights_diff <= self.tolerance)


@dataclass(frozen=True)
class SplitReport:
    layer: AttentionLayer
    projections: dict[str, ProjectionSplit]
    proof: Proof | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        layer = self.layer
        doc: dict[str, Any] = {
            "layer": layer.name,
            "family": layer.family,
            "embed_dim": layer.embed_dim,
            "kdim": layer.kdim,
            "vdim": layer.vdim,
            "num_heads": layer.num_heads,
            "num_kv_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim,
            "storage": layer.storage,
            "square": layer.is_square,
            "projections": {
                name: {
                    "shape": list(p.shape),
                    "split": p.split,
                    "stored_at": p.stored_at,
                    "heads": [_head_json(h) for h in p.heads],
                }
                for name, p in self.projections.items()
            },
        }
        if self.proof is not None:
            proof = asdict(self.proof)
            proof["max_abs_diff"] = self.proof.max_abs_diff
            proof["passed"] = self.proof.passed
            doc["max_abs_diff"] = self.proof.max_abs_diff
            doc["proof"] = proof
        return doc


def _head_json(h: HeadSlice) -> dict[str, Any]:
    doc: dict[str, Any] = {"head": h.head, "start": h.start, "stop": h.stop,
                           "shape": list(h.shape), "stored_at": h.stored_at}
    if h.query_heads:
        doc["query_heads"] = list(h.query_heads)
    return doc


def split_projections(layer: AttentionLayer) -> dict[str, ProjectionSplit]:
    """The per-head slices of each projection, from shapes alone (no tensor data)."""
    H, H_kv = layer.num_heads, layer.num_kv_heads
    assert H is not None and H_kv is not None
    q_heads = [_row_slice(layer.q_weight, h, layer.q_rows(h)) for h in range(H)]
    group = H // H_kv  # kv head g serves query heads g·group … (g+1)·group - 1 (kv_head_of)
    kv_users = {g: tuple(range(g * group, (g + 1) * group)) for g in range(H_kv)}

    def kv_slices(ref: TensorRef) -> list[HeadSlice]:
        users = kv_users if H_kv != H else {g: () for g in range(H_kv)}
        return [_row_slice(ref, g, layer.kv_rows(g), users[g]) for g in range(H_kv)]

    o_heads = []
    for h in range(H):
        start, stop = layer.o_cols(h)
        o_heads.append(HeadSlice(h, start, stop, (layer.o_weight.shape[0], stop - start),
                                 f"{layer.o_weight.describe()}[:, {start}:{stop}]"))
    return {
        "q": _projection("q", layer.q_weight, "rows", q_heads),
        "k": _projection("k", layer.k_weight, "rows", kv_slices(layer.k_weight)),
        "v": _projection("v", layer.v_weight, "rows", kv_slices(layer.v_weight)),
        "o": _projection("o", layer.o_weight, "columns", o_heads),
    }


def _row_slice(ref: TensorRef, head: int, rows: tuple[int, int],
               query_heads: tuple[int, ...] = ()) -> HeadSlice:
    start, stop = rows
    return HeadSlice(head, start, stop, (stop - start, ref.shape[1]),
                     ref.take(((start, stop),)).describe(), query_heads)


def _projection(name: str, ref: TensorRef, axis: str, heads: list[HeadSlice]) -> ProjectionSplit:
    return ProjectionSplit(name, (ref.shape[0], ref.shape[1]), axis, ref.describe(), heads)


def prove_split(layer: AttentionLayer, weights: Any, seed: int = 0, batch: int = 2,
                length: int = 6) -> Proof:
    """Run the layer on a seeded random batch twice, by the reference and head by head."""
    import torch

    from attnviz.compute.forward_pass import forward

    gen = torch.Generator().manual_seed(seed)
    device, dtype = weights.W_q.device, weights.W_q.dtype

    def sample(width: int) -> torch.Tensor:
        return torch.randn(batch, length, width, generator=gen, dtype=dtype).to(device)

    query = sample(layer.embed_dim)
    key = query if layer.kdim == layer.embed_dim else sample(layer.kdim)
    value = query if layer.vdim == layer.embed_dim else sample(layer.vdim)
    # The last sentence is one token shorter, so the key padding mask is exercised too.
    padding = torch.zeros(batch, length, dtype=torch.bool, device=device)
    padding[-1, -1] = True
    with torch.no_grad():
        if forward.torch_mha_expressible(layer):
            mha = forward.build_torch_mha(layer, weights)
            ref_out, ref_attn = forward.torch_forward(mha, query, key, value, padding)
            reference = "torch.nn.MultiheadAttention (need_weights=True)"
        else:
            ref_out, ref_attn = forward.reshaped_forward(layer, weights, query, key, value,
                                                         padding)
            reference = "F.scaled_dot_product_attention on reshaped projections"
        parts = forward.per_head_forward(layer, weights, query, key, value, padding)
    for name, tensor in (("reference output", ref_out), ("per-head output", parts.out)):
        if not torch.isfinite(tensor).all():
            raise CheckFailed(f"the {name} is not finite (NaN or Inf)",
                              fix="check the weights with 'attnviz inspect'")
    return Proof(
        reference=reference,
        output_diff=(ref_out - parts.out).abs().max().item(),
        weights_diff=(ref_attn - parts.attn).abs().max().item(),
        tolerance=PROOF_TOLERANCE,
        output_scale=max(1.0, ref_out.abs().max().item()),
        batch=batch,
        length=length,
        seed=seed,
    )


def make_report(layer: AttentionLayer, store: Any, seed: int = 0) -> tuple[SplitReport, Any]:
    """Slices, weights and the numerical proof for one layer."""
    from attnviz.compute.forward_pass.forward import load_weights

    if not layer.heads_known:
        raise UsageError(f"the number of heads of layer {layer.name or '(top level)'!r} is "
                         "unknown: it is not stored in the weights",
                         fix=f"pass {option('num_heads')} (and {option('num_kv_heads')} for "
                             "grouped-query layers)",
                         option="num_heads")
    weights = load_weights(layer, store)
    notes = []
    if layer.positions.startswith("rope"):
        notes.append(f"this layer's family rotates q and k ({layer.positions}) after the head "
                     "split; the proof runs the projections and softmax without it, which is "
                     "what the head split concerns")
    elif layer.positions in ("alibi", "relative bias"):
        notes.append(f"this layer's family adds a {layer.positions} term to the scores; the "
                     "proof runs without it, which does not touch the head split")
    report = SplitReport(layer, split_projections(layer), prove_split(layer, weights, seed), notes)
    return report, weights
