"""Long inputs in bounded memory: one head's map of one sentence at a time, reduced at once to
display-sized maps and statistics, never all heads' (or all sentences') full L × S maps together.

Memory: O(L · S) for one (head, sentence) map over its real tokens (no padding), plus
O(H · B · c²) for the c × c display maps, against O(B · H · L · S) for the full maps; time is
the same O(H · B · L · S · d) work.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from attnviz.attention import AttentionRun, LayerAttention
from attnviz.checkpoint import TensorStore
from attnviz.errors import CheckFailed
from attnviz.forward import causal_mask, load_weights
from attnviz.inputs import Batch
from attnviz.layer import AttentionLayer
from attnviz.stats import HeadStats, add_sums, finish_stats, stat_sums
from attnviz.views import MapView, downsample

MAP_BUDGET_BYTES = 256 * 2**20  # beyond this, heatmap streams instead of keeping full maps
DISPLAY_CELLS = 512  # the largest map a figure panel or terminal view needs


def full_maps_bytes(batch: Batch, num_heads: int, extra_keys: int = 0) -> int:
    return len(batch.tokens) * num_heads * batch.max_len * (batch.max_len + extra_keys) * 4


def stream_layer(layer: AttentionLayer, store: TensorStore, batch: Batch, x: torch.Tensor,
                 key: torch.Tensor, causal: bool, device: torch.device,
                 query_row: tuple[int, int] | None = None) -> LayerAttention:
    """Per-head maps → display views (per sentence and head, plus their mean) and statistics,
    for query inputs x (B, L, E) and key inputs (B, S, kdim); values do not enter the maps.
    With query_row = (sentence, query), that row of every head is kept too, for --query.

    Each sentence runs alone over its real tokens: that equals its rows of the padded batch,
    whose key padding mask only removes the padded keys.
    """
    weights = load_weights(layer, store, device=str(device))
    x, key = x.to(device), key.to(device)
    H = layer.num_heads or 0
    views: list[MapView] = []
    stats: list[HeadStats] = []
    sums: dict[int, torch.Tensor] = {}
    kept_rows: list[torch.Tensor] = []
    non_finite = False
    with torch.no_grad():
        # Whole projections once (O(B · L · H · d), small next to one head's L × S map), then
        # per-head slices of them: the same rows of W_q/W_k that head_attention takes.
        q_all = F.linear(x, weights.W_q, weights.b_q) * layer.effective_scale  # (B, L, H·d)
        k_all = F.linear(key, weights.W_k, weights.b_k)  # (B, S, H_kv·d)
        for h in range(H):
            q0, q1 = layer.q_rows(h)
            k0, k1 = layer.kv_rows(layer.kv_head_of(h))
            totals = None
            for b, tokens in enumerate(batch.tokens):
                n = len(tokens)
                k_h = k_all[b, :n, k0:k1]  # (n, d)
                if weights.bias_k is not None:  # one extra key after the real ones
                    k_h = torch.cat([k_h, weights.bias_k[None, k0:k1]])  # (n + 1, d)
                scores = q_all[b, :n, q0:q1] @ k_h.T  # (n, S) with S = n (+ 1)
                mask = sentence_mask(n, scores.shape[-1], causal, device)
                attn = torch.softmax(scores if mask is None else
                                     scores.masked_fill(mask, float("-inf")), dim=-1)
                attn, scores = attn.float().cpu(), scores.float().cpu()
                # Softmax weights lie in [0, 1], so a row sum cannot overflow: it is finite
                # exactly when the row is, at ~1/30 of the cost of isfinite() on every entry.
                if not bool(torch.isfinite(attn.sum(-1)).all()):
                    non_finite = True
                totals = add_sums(totals, stat_sums(attn[None, None], [tokens],
                                                    scores[None, None]))
                del scores
                labels = tokens + ["<bias_k>"] * (attn.shape[-1] - n)
                view = downsample(MapView(b, 0, h, attn.numpy(), list(tokens), labels, False),
                                  DISPLAY_CELLS, DISPLAY_CELLS)
                if not view.downsampled:  # a view of attn itself would keep it alive
                    view = replace(view, values=view.values.copy())
                views.append(view)
                sums[b] = sums.get(b, 0) + torch.from_numpy(view.values)
                if query_row is not None and query_row[0] == b:
                    kept_rows.append(attn[query_row[1]].clone())  # (S,)
                del attn
            stats += finish_stats(totals, 0, first_head=h)
    means = [replace(views[b], head=None, values=(sums[b] / H).numpy())
             for b in range(len(batch.tokens))]
    if non_finite:
        raise CheckFailed("the layer produced non-finite attention weights",
                          "check the weights with 'attnviz inspect --scan'")
    method = "explicit per head, streamed (one head's map of one sentence at a time)"
    return LayerAttention(0, layer, None, x.cpu(), method, views=views + means, stats=stats,
                          query_row=query_row,
                          query_weights=torch.stack(kept_rows) if kept_rows else None)


def sentence_mask(n: int, keys: int, causal: bool, device: torch.device) -> torch.Tensor | None:
    """(n, keys) bool, True = masked: causal over the n real keys; a bias_k column stays open."""
    if not causal:
        return None
    mask = causal_mask(n, device)
    return F.pad(mask, (0, keys - n), value=False) if keys > n else mask


def streamed_run(run: AttentionRun) -> bool:
    return any(layer.weights is None for layer in run.layers)
