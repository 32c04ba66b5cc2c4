"""Attention rollout (Abnar & Zuidema 2020) for one output position.

Per layer l the heads' maps (H, L, L) are reduced over heads (mean, max or min), mixed with the
identity for the residual connection, Ã_l = w·I + (1 − w)·A_l, and each row normalized to sum
to 1 (max and min rows do not). Rollout is the product Ã_n-1 ⋯ Ã_0; for one output position p
only its row is wanted, e_pᵀ Ã_n-1 ⋯ Ã_0, a row vector carried down the layers: one
vector–matrix product per layer, O(layers · L²), never a matrix–matrix product (O(L³)).

Convention: maps are [head, query, key] (row i: what query i reads), one sentence, real tokens
only. Vectors are indexed by token; `chain[k]` is how much the representation of each token
entering layer k reaches the output (chain[0]: the inputs, chain[n]: e_p).
"""

from __future__ import annotations

import torch

from attnviz.core.choices import HeadReduce


def reduce_heads(maps: torch.Tensor, how: HeadReduce) -> torch.Tensor:
    """(L, L) from per-head maps (H, L, L)."""
    if how is HeadReduce.MAX:
        return maps.amax(0)
    if how is HeadReduce.MIN:
        return maps.amin(0)
    return maps.mean(0)


def mixed(maps: torch.Tensor, how: HeadReduce, residual_weight: float) -> torch.Tensor:
    """Ã = row-normalized w·I + (1 − w)·reduce(maps): (L, L) float64."""
    A = reduce_heads(maps.double(), how)  # (L, L)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    M = residual_weight * eye + (1.0 - residual_weight) * A
    total = M.sum(-1, keepdim=True)
    # a row can only sum to 0 with w = 0 and a fully masked query: it then passes nothing on
    return torch.where(total > 0, M / total.clamp(min=torch.finfo(M.dtype).tiny), 0.0)


def carry_down(matrices: list[torch.Tensor], position: int) -> torch.Tensor:
    """(n + 1, L): e_pᵀ carried down through the layers' (L, L) matrices, last layer first;
    row k is the vector entering layer k (row 0: the inputs)."""
    L = matrices[0].shape[-1] if matrices else position + 1
    v = torch.zeros(L, dtype=torch.float64)
    v[position] = 1.0
    rows = [v]
    for M in reversed(matrices):
        v = v @ M.to(v.dtype).cpu()  # (L,) · (L, L): O(L²)
        rows.append(v)
    return torch.stack(rows[::-1])


def rollout(maps: list[torch.Tensor], position: int, how: HeadReduce,
            residual_weight: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(chain (n + 1, L), the mixed matrices Ã_l) for per-layer maps (H, L, L)."""
    matrices = [mixed(m, how, residual_weight) for m in maps]
    return carry_down(matrices, position), matrices


ROLLOUT_BLOCK_BYTES = 1 << 22  # the float64 copy of a block of rows of the maps (4 MB)


def rollout_chain(maps: list[torch.Tensor], position: int, how: HeadReduce,
                  residual_weight: float) -> torch.Tensor:
    """(n + 1, L): the same chain as `rollout`, without forming any L × L matrix for the mean:
    v Ã = w·v + (1 − w)·(1/H) Σ_h v A_h when every row of the maps sums to 1 (a query with no
    key left, whose row is 0, is normalized as `mixed` does); max and min form their reduced
    map once (exact in the maps' own dtype). O(layers · H · L²) multiply-adds, the cost of
    reading the maps once: only the rows the vector reaches (a causal model's top layer: the
    output's row alone), in float64 a block of rows at a time."""
    L = maps[0].shape[-1] if maps else position + 1
    v = torch.zeros(L, dtype=torch.float64)
    v[position] = 1.0
    rows = [v]
    w = residual_weight
    for A in reversed(maps):
        if how is HeadReduce.MEAN:
            v = _mean_step(A, v, w)
        else:
            R = reduce_heads(A, how).double()
            scale = w + (1.0 - w) * R.sum(-1)
            u = torch.where(scale > 0, v / scale.clamp(min=torch.finfo(v.dtype).tiny), 0.0)
            v = w * u + (1.0 - w) * (u @ R)
        rows.append(v)
    return torch.stack(rows[::-1])


def _mean_step(A: torch.Tensor, v: torch.Tensor, w: float) -> torch.Tensor:
    """v Ã for the heads' mean, over the rows where v is not 0."""
    H, L, _ = A.shape
    reached = v.nonzero().flatten()
    step = max(1, ROLLOUT_BLOCK_BYTES // (8 * H * L))
    u = torch.zeros_like(v)
    mixed_in = torch.zeros_like(v)
    for start in range(0, len(reached), step):
        chunk = reached[start:start + step]
        block = A.index_select(1, chunk).double()  # (H, r, L)
        scale = w + (1.0 - w) * block.sum(-1).mean(0)  # each row's sum (1, or 0 if empty)
        part = torch.where(scale > 0, v[chunk] / scale.clamp(min=torch.finfo(v.dtype).tiny),
                           0.0)
        u[chunk] = part
        mixed_in += torch.einsum("i,hij->j", part, block)
    return w * u + (1.0 - w) * mixed_in / H
