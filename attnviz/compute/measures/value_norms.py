"""Value-weighted attention (Kobayashi et al. 2020, "Attention is Not Only a Weight"): the size of
what head h writes from key j into query i's output,

    ‖α_ij · W_O[:, cols(h)] (W_V^{g(h)} x_j + b_V^{g(h)})‖ = α_ij · ‖f_h(x_j)‖,

since α_ij ≥ 0 is a scalar. So a whole norm map is the attention map times one per-key norm
(B, H, S): `key_norms` computes it from a layer's weights and its inputs, `state_norms` from the
per-head value states a model's own attention received. A head that puts 0.9 on `[CLS]` but
writes almost nothing from it has a large weight and a small norm there.

Shapes: value inputs (B, S, vdim); value states (B, H_kv, S, d); W_O (E, H·d) in (out, in)
orientation; maps (B, H, L, S).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass.forward import LayerWeights
from attnviz.core.choices import Weighting
from attnviz.core.layer import AttentionLayer

NORM_LEGEND = "‖α·W_O v‖, each row normalized to sum to 1"
WEIGHTINGS = Weighting.values()


def state_norms(values: torch.Tensor, W_o: torch.Tensor, o_cols: Callable[[int], tuple[int, int]],
                kv_head_of: Callable[[int], int], num_heads: int) -> torch.Tensor:
    """(B, H, S) ‖W_O[:, cols(h)] v_j^{g(h)}‖ from value states (B, H_kv, S, d)."""
    blocks = torch.stack([W_o[:, slice(*o_cols(h))] for h in range(num_heads)])  # (H, E, d)
    groups = torch.tensor([kv_head_of(h) for h in range(num_heads)], device=values.device)
    per_head = values.to(blocks.dtype).index_select(1, groups)  # (B, H, S, d)
    # ‖W v‖² = vᵀ (WᵀW) v: a (d × d) Gram matrix per head, never a (B, H, S, E) tensor
    gram = blocks.transpose(1, 2) @ blocks  # (H, d, d)
    squared = torch.einsum("bhsd,hde,bhse->bhs", per_head, gram, per_head)
    return squared.clamp(min=0).sqrt()


def key_norms(layer: AttentionLayer, weights: LayerWeights, value_in: torch.Tensor
              ) -> torch.Tensor:
    """(B, H, S [+1]) per-key norms of a layer on its value inputs (B, S, vdim); a bias_v key
    (nn.MultiheadAttention's add_bias_kv) is the last column, as in its maps."""
    H, H_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    assert H is not None and H_kv is not None and d is not None
    v = F.linear(value_in.to(weights.W_v.dtype), weights.W_v, weights.b_v)  # (B, S, H_kv·d)
    states = torch.stack([v[..., slice(*layer.kv_rows(g))] for g in range(H_kv)], 1)
    if weights.bias_v is not None:  # the extra key appended after projection
        extra = torch.stack([weights.bias_v[slice(*layer.kv_rows(g))] for g in range(H_kv)])
        states = torch.cat([states, extra[None, :, None].expand(states.shape[0], -1, 1, -1)], 2)
    return state_norms(states, weights.W_o, layer.o_cols, layer.kv_head_of, H)


def norm_maps(attn: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Raw value-weighted maps α_ij · ‖f_h(x_j)‖ (B, H, L, S) from attention (B, H, L, S) and
    per-key norms (B, H, S)."""
    return attn * norms[:, :, None, :].to(attn.dtype)


def normalized_rows(raw: torch.Tensor) -> torch.Tensor:
    """Each row divided by its sum (a row that writes nothing stays 0): comparable to weights."""
    total = raw.sum(-1, keepdim=True)
    return torch.where(total > 0, raw / total.clamp(min=torch.finfo(raw.dtype).tiny), 0.0)
