"""Long inputs in bounded memory: one head's (B, L, S) map at a time, reduced at once to
display-sized maps and statistics, never all heads' full L × S maps together.

Memory: O(B · L · S) for one head (plus O(H · B · c²) for c × c display maps), against
O(B · H · L · S) for the full maps; time is the same O(H · B · L · S · d) work.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from attnviz.attention import AttentionRun, LayerAttention
from attnviz.errors import CheckFailed
from attnviz.forward import causal_mask, load_weights, merged_mask
from attnviz.inputs import Batch
from attnviz.layer import AttentionLayer
from attnviz.stats import head_stats
from attnviz.views import MapView, downsample

MAP_BUDGET_BYTES = 256 * 2**20  # beyond this, heatmap streams instead of keeping full maps
DISPLAY_CELLS = 512  # the largest map a figure panel or terminal view needs


def full_maps_bytes(batch: Batch, num_heads: int, extra_keys: int = 0) -> int:
    return len(batch.tokens) * num_heads * batch.max_len * (batch.max_len + extra_keys) * 4


def stream_layer(layer: AttentionLayer, store, batch: Batch, x: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, pad: torch.Tensor, causal: bool,
                 device: torch.device) -> LayerAttention:
    """Per-head maps → display views (per sentence and head, plus their mean) and statistics."""
    weights = load_weights(layer, store, device=str(device))
    x, key, value, pad = x.to(device), key.to(device), value.to(device), pad.to(device)
    mask = merged_mask(pad if bool(pad.any()) else None,
                       causal_mask(x.shape[1], device) if causal else None,
                       weights.bias_k is not None)
    H = layer.num_heads or 0
    views: list[MapView] = []
    stats = []
    sums: dict[int, torch.Tensor] = {}
    non_finite = False
    with torch.no_grad():
        # Whole projections once (O(B · L · H · d), small next to one head's L × S map), then
        # per-head slices of them: the same rows of W_q/W_k that head_attention takes.
        q_all = F.linear(x, weights.W_q, weights.b_q) * layer.effective_scale  # (B, L, H·d)
        k_all = F.linear(key, weights.W_k, weights.b_k)  # (B, S, H_kv·d)
        if weights.bias_k is not None:
            k_all = torch.cat([k_all, weights.bias_k.view(1, 1, -1).expand(len(k_all), 1, -1)],
                              1)
        for h in range(H):
            q0, q1 = layer.q_rows(h)
            k0, k1 = layer.kv_rows(layer.kv_head_of(h))
            scores = q_all[..., q0:q1] @ k_all[..., k0:k1].transpose(-1, -2)  # (B, L, S)
            attn = torch.softmax(scores if mask is None else
                                 scores.masked_fill(mask, float("-inf")), dim=-1)
            attn, scores = attn.float().cpu(), scores.float().cpu()
            # Softmax weights lie in [0, 1], so a row sum cannot overflow: it is finite exactly
            # when the row is, at ~1/30 of the cost of isfinite() over all L × S entries.
            if not bool(torch.isfinite(attn.sum(-1)).all()):
                non_finite = True
            stats += [replace(s, head=h) for s in head_stats(attn[:, None], batch.tokens, 0,
                                                             scores[:, None])]
            del scores
            for b, tokens in enumerate(batch.tokens):
                n = len(tokens)
                extra = attn.shape[-1] - batch.max_len  # bias_k columns follow the padding
                values = attn[b, :n, :n] if not extra else torch.cat(
                    [attn[b, :n, :n], attn[b, :n, batch.max_len:]], -1)
                labels = tokens + ["<bias_k>"] * extra
                view = downsample(MapView(b, 0, h, values.numpy(), list(tokens), labels, False),
                                  DISPLAY_CELLS, DISPLAY_CELLS)
                if not view.downsampled:  # a view into attn would keep every head's map alive
                    view = replace(view, values=view.values.copy())
                views.append(view)
                sums[b] = sums.get(b, 0) + torch.from_numpy(view.values)
            del attn
    means = [replace(views[b], head=None, values=(sums[b] / H).numpy())
             for b in range(len(batch.tokens))]
    if non_finite:
        raise CheckFailed("the layer produced non-finite attention weights",
                          "check the weights with 'attnviz inspect --scan'")
    method = "explicit per head, streamed (one head's map at a time)"
    return LayerAttention(0, layer, None, x.cpu(), method, views=views + means, stats=stats)


def streamed_run(run: AttentionRun) -> bool:
    return any(layer.weights is None for layer in run.layers)
