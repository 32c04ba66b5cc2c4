"""Long inputs in bounded memory: one head's map of one sentence at a time, reduced at once to
display-sized maps and statistics, never all heads' (or all sentences') full L × S maps together.

Memory: O(L · S) for one (head, sentence) map over its real tokens (no padding), plus
O(H · B · c²) for the c × c display maps, against O(B · H · L · S) for the full maps; time is
the same O(H · B · L · S · d) work. `MapReducer` does the reduction for standalone layers
(`stream_layer`) and for Hugging Face models alike (`attnviz.sources.hf`, from the model's own
maps).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from attnviz.compute.forward import causal_mask, load_weights, merged_mask
from attnviz.compute.inputs import Batch
from attnviz.compute.maps import MAX_VIEW_HEADS, MapView, downsample
from attnviz.compute.results import LayerAttention
from attnviz.compute.stats import StatSums, add_sums, finish_stats, stat_sums
from attnviz.core.layer import AttentionLayer
from attnviz.errors import CheckFailed
from attnviz.load.checkpoint import TensorStore

MAP_BUDGET_BYTES = 256 * 2**20  # beyond this, heatmap streams instead of keeping full maps
DISPLAY_CELLS = 512  # the largest map a figure panel or terminal view needs
STREAMED = "one head's map of one sentence at a time"


def full_maps_bytes(batch: Batch, num_heads: int, extra_keys: int = 0, layers: int = 1) -> int:
    return layers * len(batch.tokens) * num_heads * batch.max_len * (batch.max_len + extra_keys) * 4


class MapReducer:
    """One layer's display views (per sentence and head, plus each sentence's mean over heads),
    summable head statistics and, for --query, one query's row of every head; fed one block of
    heads of one sentence at a time, none of which it keeps."""

    def __init__(self, layer_index: int, tokens: list[list[str]],
                 query_row: tuple[int, int] | None = None) -> None:
        self.layer_index = layer_index
        self.tokens = tokens
        self.query_row = query_row  # (sentence, query)
        self.views: list[MapView] = []
        self._sums: dict[int, StatSums] = {}  # per head, over the sentences seen
        self._mean: dict[int, tuple[torch.Tensor, int]] = {}  # per sentence: Σ views, heads
        self._rows: dict[int, torch.Tensor] = {}  # per head: the query's row (S,)
        self._non_finite = False

    def add(self, sentence: int, first_head: int, attn: torch.Tensor,
            scores: torch.Tensor | None = None) -> None:
        """attn (heads, n, S) float32 on the CPU: the sentence's n real queries against its real
        keys (then any bias_k column); scores, when given, the pre-softmax scores it came from."""
        tokens = self.tokens[sentence]
        n = len(tokens)
        # Softmax weights lie in [0, 1], so a row sum cannot overflow: it is finite exactly
        # when the row is, at ~1/30 of the cost of isfinite() on every entry.
        if not bool(torch.isfinite(attn.sum(-1)).all()):
            self._non_finite = True
        sums, counts = stat_sums(attn[None], [tokens], None if scores is None else scores[None])
        labels = tokens + ["<bias_k>"] * (attn.shape[-1] - n)
        for j in range(attn.shape[0]):
            head = first_head + j
            self._sums[head] = add_sums(self._sums.get(head),
                                        ({k: v[j : j + 1] for k, v in sums.items()}, counts))
            view = downsample(MapView(sentence, self.layer_index, head, attn[j].numpy(),
                                      list(tokens), labels, False), DISPLAY_CELLS, DISPLAY_CELLS)
            if not view.downsampled:  # a view of attn itself would keep the whole block alive
                view = replace(view, values=view.values.copy())
            if head < MAX_VIEW_HEADS:
                self.views.append(view)
            total, heads = self._mean.get(sentence, (0, 0))
            self._mean[sentence] = (total + torch.from_numpy(view.values), heads + 1)
            if self.query_row is not None and self.query_row[0] == sentence:
                self._rows[head] = attn[j, self.query_row[1]].clone()

    def finish(self, layer: AttentionLayer, inputs: torch.Tensor | None,
               method: str) -> LayerAttention:
        if self._non_finite:
            raise CheckFailed(f"layer {self.layer_index} produced non-finite attention weights",
                              "check the weights with 'attnviz inspect --scan'")
        first_view = {}
        for view in self.views:
            first_view.setdefault(view.sentence, view)
        means = [replace(first_view[b], head=None, values=(total / heads).numpy())
                 for b, (total, heads) in sorted(self._mean.items())]
        stats = [s for head in sorted(self._sums)
                 for s in finish_stats(self._sums[head], self.layer_index, first_head=head)]
        rows = torch.stack([self._rows[h] for h in sorted(self._rows)]) if self._rows else None
        return LayerAttention(self.layer_index, layer, None, inputs, method,
                              views=self.views + means, stats=stats,
                              query_row=self.query_row if rows is not None else None,
                              query_weights=rows)


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
    reducer = MapReducer(0, batch.tokens, query_row)
    with torch.no_grad():
        # Whole projections once (O(B · L · H · d), small next to one head's L × S map), then
        # per-head slices of them: the same rows of W_q/W_k that head_attention takes.
        q_all = F.linear(x, weights.W_q, weights.b_q) * layer.effective_scale  # (B, L, H·d)
        k_all = F.linear(key, weights.W_k, weights.b_k)  # (B, S, H_kv·d)
        for h in range(layer.num_heads or 0):
            q0, q1 = layer.q_rows(h)
            k0, k1 = layer.kv_rows(layer.kv_head_of(h))
            for b, tokens in enumerate(batch.tokens):
                n = len(tokens)
                # (1, n, S) or None: causal over the real keys, a bias_k column left open
                mask = merged_mask(None, causal_mask(n, device) if causal else None,
                                   weights.bias_k is not None)
                k_h = k_all[b, :n, k0:k1]  # (n, d)
                if weights.bias_k is not None:  # one extra key after the real ones
                    k_h = torch.cat([k_h, weights.bias_k[None, k0:k1]])  # (n + 1, d)
                scores = q_all[b, :n, q0:q1] @ k_h.T  # (n, S) with S = n (+ 1)
                attn = torch.softmax(scores if mask is None else
                                     scores.masked_fill(mask[0], float("-inf")), dim=-1)
                reducer.add(b, h, attn.float().cpu()[None], scores.float().cpu()[None])
                del scores, attn
    return reducer.finish(layer, x.cpu(), f"explicit per head, streamed ({STREAMED})")

