"""The real attention computation: torch's own module where the layer fits it, explicit per head
otherwise, and the per-head recomputation from weight slices that `split` uses as its proof.

Shapes: x (B, L, E) query input, key/value inputs (B, S, kdim|vdim); masks follow
`attnviz.compute.forward_pass.kernel`'s convention (bool, True = masked); maps are (B, H, L, S).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass import kernel
from attnviz.core.layer import AttentionLayer
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import CheckpointError, option, quoted
from attnviz.load.store import TensorStore


@dataclass(frozen=True)
class LayerWeights:
    """A layer's tensors, in (out, in) orientation, float32 unless asked otherwise."""

    W_q: torch.Tensor  # (H·d, E)
    W_k: torch.Tensor  # (H_kv·d, kdim)
    W_v: torch.Tensor  # (H_kv·d, vdim)
    W_o: torch.Tensor  # (E, H·d)
    b_q: torch.Tensor | None
    b_k: torch.Tensor | None
    b_v: torch.Tensor | None
    b_o: torch.Tensor | None
    bias_k: torch.Tensor | None  # (H_kv·d,) extra key appended after projection
    bias_v: torch.Tensor | None

    @property
    def bias_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bias_k, bias_v) when the layer appends an extra key/value (they come in pairs)."""
        if self.bias_k is None or self.bias_v is None:
            return None
        return self.bias_k, self.bias_v


def read_ref(store: TensorStore, ref: TensorRef) -> torch.Tensor:
    """The tensor `ref` denotes, in (out, in) orientation, reading only its rows where possible."""
    ranges = ref.row_ranges
    if not ref.transposed and not ref.flatten and ranges is not None and len(ranges) == 1:
        (start, stop), = ranges
        return store.read_rows(ref.key, start, stop)
    blocks = ref.row_blocks(ref.oriented(store.read(ref.key)))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def load_weights(layer: AttentionLayer, store: TensorStore,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> LayerWeights:
    """The layer's tensors, each refused by name when it holds NaN or Inf (a forward would turn
    every map it touches into NaN, and a proof or figure would be blank or misleading)."""
    roles = {id(ref): role for role, ref in (
        ("W_q", layer.q_weight), ("W_k", layer.k_weight), ("W_v", layer.v_weight),
        ("W_o", layer.o_weight), ("b_q", layer.q_bias), ("b_k", layer.k_bias),
        ("b_v", layer.v_bias), ("b_o", layer.o_bias), ("bias_k", layer.bias_k),
        ("bias_v", layer.bias_v)) if ref is not None}

    def need(ref: TensorRef) -> torch.Tensor:
        tensor = read_ref(store, ref)
        where_in = quoted(layer.name or "(top level)")
        refuse_non_finite(tensor, ref.key, f"{roles[id(ref)]} of layer {where_in}", store.source)
        return tensor.to(device=device, dtype=dtype).contiguous()

    def get(ref: TensorRef | None) -> torch.Tensor | None:
        return None if ref is None else need(ref)

    return LayerWeights(
        W_q=need(layer.q_weight), W_k=need(layer.k_weight), W_v=need(layer.v_weight),
        W_o=need(layer.o_weight), b_q=get(layer.q_bias), b_k=get(layer.k_bias),
        b_v=get(layer.v_bias), b_o=get(layer.o_bias), bias_k=get(layer.bias_k),
        bias_v=get(layer.bias_v),
    )


def refuse_non_finite(tensor: torch.Tensor, key: str, what: str, where: str) -> None:
    """One error naming the stored tensor `key` (`what` it is) when it holds NaN or Inf."""
    values = tensor if tensor.is_floating_point() and tensor.element_size() >= 2 \
        else tensor.float()  # float8 has no isfinite kernel on a CPU
    bad = int((~torch.isfinite(values)).sum())
    if not bad:
        return
    nan = int(torch.isnan(values).sum())
    counts = ", ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (bad - nan, "Inf")) if n)
    raise CheckpointError(f"tensor {quoted(key)} ({what}) holds non-finite values ({counts})",
                          fix=f"repair or re-export the checkpoint ('attnviz inspect "
                          f"{option('scan')}' counts non-finite values per tensor)", where=where)


def torch_mha_expressible(layer: AttentionLayer) -> bool:
    """Whether torch.nn.MultiheadAttention can hold this layer exactly."""
    return (layer.heads_known and layer.is_square and layer.num_kv_heads == layer.num_heads
            and layer.scale is None)


def build_torch_mha(layer: AttentionLayer, weights: LayerWeights) -> torch.nn.MultiheadAttention:
    """An nn.MultiheadAttention holding exactly this layer's weights (missing biases are zero)."""
    E, H = layer.embed_dim, layer.num_heads
    has_bias = any(b is not None for b in (weights.b_q, weights.b_k, weights.b_v, weights.b_o))
    mha = torch.nn.MultiheadAttention(
        E, H, bias=has_bias, add_bias_kv=weights.bias_k is not None, kdim=layer.kdim,
        vdim=layer.vdim, batch_first=True, device=weights.W_q.device, dtype=weights.W_q.dtype,
    )
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([weights.W_q, weights.W_k, weights.W_v]))
        else:
            mha.q_proj_weight.copy_(weights.W_q)
            mha.k_proj_weight.copy_(weights.W_k)
            mha.v_proj_weight.copy_(weights.W_v)
        mha.out_proj.weight.copy_(weights.W_o)
        if has_bias:
            zeros = torch.zeros(E, device=weights.W_q.device, dtype=weights.W_q.dtype)
            parts = [b if b is not None else zeros for b in (weights.b_q, weights.b_k, weights.b_v)]
            mha.in_proj_bias.copy_(torch.cat(parts))
            mha.out_proj.bias.copy_(weights.b_o if weights.b_o is not None else zeros)
        if weights.bias_kv is not None and mha.bias_k is not None and mha.bias_v is not None:
            bias_k, bias_v = weights.bias_kv
            mha.bias_k.copy_(bias_k.view(1, 1, -1))
            mha.bias_v.copy_(bias_v.view(1, 1, -1))
    return mha.eval()


def torch_forward(mha: torch.nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own forward: (output (B, L, E), per-head weights (B, H, L, S))."""
    with torch.no_grad():
        out, attn = mha(query, key, value, key_padding_mask=key_padding_mask,
                        attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
    return out, attn


@dataclass(frozen=True)
class HeadParts:
    """Per-head intermediate tensors of the explicit computation."""

    q: torch.Tensor  # (B, H, L, d) each head's slice of the projected query
    k: torch.Tensor  # (B, H, S, d) the key slice each query head uses
    v: torch.Tensor  # (B, H, S, d)
    scores: torch.Tensor  # (B, H, L, S) scaled q·kᵀ, before masking
    attn: torch.Tensor  # (B, H, L, S) after mask and softmax
    out: torch.Tensor  # (B, L, E) after W_o


def per_head_forward(layer: AttentionLayer, weights: LayerWeights, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor,
                     key_padding_mask: torch.Tensor | None = None,
                     attn_mask: torch.Tensor | None = None) -> HeadParts:
    """Attention computed head by head from weight slices alone.

    q_h = x · W_q[rows_h]ᵀ + b_q[rows_h]; out_h = softmax(scale · q_h k_hᵀ) v_h;
    output = Σ_h out_h · W_o[:, cols_h]ᵀ + b_o.
    """
    H = layer.num_heads
    assert H is not None
    qs: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    attns: list[torch.Tensor] = []
    out = torch.zeros(*query.shape[:-1], layer.embed_dim, dtype=query.dtype, device=query.device)
    mask = merged_mask(key_padding_mask, attn_mask, weights.bias_k is not None)
    for h in range(H):
        q_h, k_h, v_h, s_h, a_h = head_attention(layer, weights, h, (query, key, value), mask)
        q0, q1 = layer.q_rows(h)
        out = out + (a_h @ v_h) @ weights.W_o[:, q0:q1].T  # (B, L, E)
        for parts, part in zip((qs, ks, vs, scores, attns), (q_h, k_h, v_h, s_h, a_h),
                               strict=True):
            parts.append(part)
    if weights.b_o is not None:
        out = out + weights.b_o
    stack = lambda xs: torch.stack(xs, dim=1)  # noqa: E731
    return HeadParts(stack(qs), stack(ks), stack(vs), stack(scores), stack(attns), out)


def head_attention(layer: AttentionLayer, weights: LayerWeights, head: int,
                   inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One head from its slices: (q_h, k_h, v_h, scaled scores, weights) for inputs = (query,
    key, value); mask from `merged_mask` (True = masked)."""
    query, key, value = inputs
    rows, kv_rows = layer.q_rows(head), layer.kv_rows(layer.kv_head_of(head))
    q_h = kernel.project(query, weights.W_q, weights.b_q, rows)  # (B, L, d)
    k_h = kernel.project(key, weights.W_k, weights.b_k, kv_rows)  # (B, S, d)
    v_h = kernel.project(value, weights.W_v, weights.b_v, kv_rows)  # (B, S, d)
    if weights.bias_kv is not None:
        k0, k1 = kv_rows
        bias_k, bias_v = weights.bias_kv
        k_h = _append_position(k_h, bias_k[k0:k1])  # (B, S+1, d)
        v_h = _append_position(v_h, bias_v[k0:k1])
    s_h, a_h = kernel.head_weights(q_h, k_h, layer.effective_scale, mask)  # (B, L, S) each
    return q_h, k_h, v_h, s_h, a_h


def reshaped_forward(layer: AttentionLayer, weights: LayerWeights, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor,
                     key_padding_mask: torch.Tensor | None = None,
                     attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent computation for layers nn.MultiheadAttention cannot hold (GQA, H·d ≠ E):
    whole projections reshaped into heads, output by F.scaled_dot_product_attention.
    Returns (output (B, L, E), weights (B, H, L, S))."""
    H, H_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    assert H is not None and H_kv is not None and d is not None
    B, L, S = query.shape[0], query.shape[1], key.shape[1]
    q = F.linear(query, weights.W_q, weights.b_q).view(B, L, H, d).transpose(1, 2)  # (B, H, L, d)
    k = F.linear(key, weights.W_k, weights.b_k).view(B, S, H_kv, d).transpose(1, 2)
    v = F.linear(value, weights.W_v, weights.b_v).view(B, S, H_kv, d).transpose(1, 2)
    if weights.bias_kv is not None:
        bias_k, bias_v = weights.bias_kv
        k = torch.cat([k, bias_k.view(1, H_kv, 1, d).expand(B, -1, -1, -1)], dim=2)
        v = torch.cat([v, bias_v.view(1, H_kv, 1, d).expand(B, -1, -1, -1)], dim=2)
    k = k.repeat_interleave(H // H_kv, dim=1)  # (B, H, S, d), as transformers' repeat_kv
    v = v.repeat_interleave(H // H_kv, dim=1)
    mask = merged_mask(key_padding_mask, attn_mask, weights.bias_k is not None)
    allowed = None if mask is None else ~mask.unsqueeze(1)  # SDPA: True = may attend
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=layer.effective_scale)
    out = F.linear(ctx.transpose(1, 2).reshape(B, L, H * d), weights.W_o, weights.b_o)
    scores = layer.effective_scale * q @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
    return out, torch.softmax(scores, dim=-1)


def _append_position(t: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, extra.view(1, 1, -1).expand(t.shape[0], 1, -1)], dim=1)


def merged_mask(key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                 extra_key: bool) -> torch.Tensor | None:
    """One bool mask (B or 1, L or 1, S) with True = masked, padded for a bias_k column."""
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask[:, None, :]  # (B, 1, S)
    if attn_mask is not None:
        mask = attn_mask[None] if mask is None else mask | attn_mask[None]
    if mask is not None and extra_key:
        mask = F.pad(mask, (0, 1), value=False)
    return mask
