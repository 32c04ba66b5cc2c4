"""The one per-head attention kernel: weights = softmax(scale · q_h k_hᵀ, masked), in its plain
form (`head_weights`, any batch shape) and its fast form for long inputs (`block_softmax`, one
block of query rows into preallocated buffers).

The mask convention, everywhere in attnviz: a bool tensor broadcastable to the scores (…, L, S)
with True = masked (the query does not see that key), as torch.nn.MultiheadAttention's
`attn_mask` and `key_padding_mask`. Masks written the other way round (SDPA's and Hugging Face's
bool masks, True = may attend) are flipped where they enter. Masked entries get weight 0.

torch's nn.MultiheadAttention and F.scaled_dot_product_attention never run through this module:
they are the independent references the kernel is checked against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            rows: tuple[int, int]) -> torch.Tensor:
    """x (…, E) through rows start..stop of an (out, in) projection: one head's (…, d) slice."""
    start, stop = rows
    return F.linear(x, weight[start:stop], None if bias is None else bias[start:stop])


def scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """scale · q kᵀ (…, L, S) for q (…, L, d) and k (…, S, d); the scale goes on q, the
    smaller side."""
    return (q * scale) @ k.transpose(-1, -2)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the last dim with masked entries (True) excluded.

    sinks, optional (…, 1): one extra logit per row that takes part in the normalizer and is
    then dropped (gpt-oss's attention sinks), so a row's weights may sum to less than 1.
    """
    logits = scores if mask is None else scores.masked_fill(mask, float("-inf"))
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def head_weights(q: torch.Tensor, k: torch.Tensor, scale: float,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, weights) of one head or a stack of heads: scale · q kᵀ before the mask, and
    its masked softmax."""
    scores = scaled_scores(q, k, scale)
    return scores, masked_softmax(scores, mask)


def causal_mask(queries: int, keys: int | None = None,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """(queries, keys) bool, True above the diagonal: query i does not see keys after i."""
    return torch.ones(queries, queries if keys is None else keys, dtype=torch.bool,
                      device=device).triu(1)


def window_mask(length: int, window: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """(L, L) bool, True where key j lies a window or more behind query i (i - j ≥ window)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril(-window)


def padding_mask(lengths: list[int], width: int) -> torch.Tensor:
    """(B, width) bool, True at the keys past each sentence's length (right padding)."""
    return torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]


# Blocks repeat a few shapes thousands of times: their small causal masks are built once.
_block_causal_mask = functools.lru_cache(maxsize=16)(causal_mask)


def block_softmax(q: torch.Tensor, k: torch.Tensor, k_extra: torch.Tensor | None,
                  row_start: int, causal: bool, buffers: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """head_weights for one block of query rows of a stack of heads, exactly, without
    allocating the block: (weights, scores, K, row max) with weights and scores (h, r, K + extra)
    views into the two flat buffers (scores, weights), and each row's largest score (h, r) over
    the keys it sees.

    q (h, r, d), already scaled: queries row_start.. of the sentence, per head; k (h, n, d) its
    real keys for those heads; k_extra (h, extra, d) keys after them (bias_k), never masked.
    Causal: queries see keys up to their own position, so only the first K = min(row_start +
    r, n) keys are computed at all, and the causal mask covers only the r × r keys beside the
    block. One batched matmul and one fused softmax per block (row max, exp, normalizer, per
    row); masked entries get weight 0 and a score of 0 afterwards (finite, for the entropy's
    Σ a·s).
    """
    scores_buf, weights_buf = buffers
    h, r, n = q.shape[0], q.shape[1], k.shape[1]
    keys = min(row_start + r, n) if causal else n
    extra = 0 if k_extra is None else k_extra.shape[1]
    width = keys + extra
    scores = scores_buf[: h * r * width].view(h, r, width)  # (h, r, K + extra)
    weights = weights_buf[: h * r * width].view(h, r, width)
    seen = k[:, :keys] if k_extra is None else torch.cat([k[:, :keys], k_extra], 1)
    torch.bmm(q, seen.transpose(1, 2), out=scores)
    masked = beside = None
    if causal and row_start < keys:
        masked = _block_causal_mask(r, keys - row_start, str(q.device))
        beside = scores[..., row_start:keys]  # (h, r, r'): the keys at the block's own positions
        beside.masked_fill_(masked, float("-inf"))
    row_max = scores.amax(-1)
    torch.ops.aten._softmax.out(scores, -1, False, out=weights)
    if beside is not None and masked is not None:
        beside.masked_fill_(masked, 0.0)
    return weights, scores, keys, row_max
