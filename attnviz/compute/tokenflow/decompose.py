"""Residual- and norm-aware token-to-token contributions of one attention block (Kobayashi et
al. 2021; ALTI, Ferrando et al. 2022), and their composition across layers.

An attention block's output for token i is a sum of one term per source token j,

    y_i = Σ_j T_ij,   T_ij = Σ_h α^h_ij U^h_j + ᾱ_ij b_O + [i = j] r_i,

U^h_j = W_O[:, cols(h)] (W_V^h x_j + b_V^h) what head h writes from token j, ᾱ_ij the heads'
mean weight (the output bias shared as attention shares the rest: Σ_j ᾱ_ij = 1), r_i the
residual. A norm after the residual (post-LN: BERT, BART) is linear once its per-token scale is
fixed: LN(Σ_j T_ij) = Σ_j γ ⊙ (T_ij − mean(T_ij)) / σ_i + ᾱ_ij β, with σ_i the scale of the
whole sum, so the identity Σ_j T_ij = y_i holds after it too (an RMSNorm: γ ⊙ T_ij / rms_i).

Kobayashi et al. 2021 ("norms"): c_ij = ‖T_ij‖₂, each row normalized.
ALTI: c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_ij‖₁), each row normalized.
Across layers the contributions compose like rollout (a row vector carried down).

Shapes: maps (H, L, L) [head, query, key]; values U (H, L, E); residual (L, E); one sentence.
Terms are built for a block of query rows at a time: (rows, L, E) floats, sized by the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.core.choices import TokenMethod

CONTRIBUTION_METHODS = (TokenMethod.NORMS, TokenMethod.ALTI)


@dataclass(frozen=True)
class PostNorm:
    """A norm applied after the residual sum (post-LN models)."""

    weight: torch.Tensor  # (E,)
    bias: torch.Tensor | None  # (E,)
    eps: float
    rms: bool = False  # RMSNorm: no mean subtracted, no bias


@dataclass(frozen=True)
class BlockTerms:
    """What one attention block's per-source terms are made of, for one sentence."""

    maps: torch.Tensor  # (H, L, L) attention weights
    values: torch.Tensor  # (H, L, E) U^h_j = W_O^h v^h_j (value bias included)
    residual: torch.Tensor  # (L, E) r_i, added to the term of j = i
    out_bias: torch.Tensor | None  # (E,) b_O
    post_norm: PostNorm | None = None
    output: torch.Tensor | None = None  # (L, E) the block's own output, where the source read it
    identity_rtol: float = 1e-4  # how close Σ_j T_ij must come to `output` (its dtype's rounding)


def check_identity(block: BlockTerms, rows: torch.Tensor, y: torch.Tensor) -> None:
    """Σ_j T_ij against the block's own output for these rows, when the source read it: a
    family described wrongly (a value slice, a norm in another place) is refused, never shown."""
    if block.output is None:
        return
    want = block.output[rows].double()
    error = float((y - want).norm() / want.norm().clamp(min=1e-30))
    if error > block.identity_rtol:
        from attnviz.errors import CheckFailed, option

        raise CheckFailed(f"the per-source terms of an attention block do not add up to the "
                          f"block's own output (relative error {error:.1e}): attnviz describes "
                          "this model's blocks wrongly", fix=f"choose rollout or flow with "
                          f"{option('method')}, and report this model")


def terms(block: BlockTerms, rows: torch.Tensor) -> torch.Tensor:
    """(len(rows), L, E) float64: T_ij for the query rows `rows`."""
    alpha = block.maps[:, rows].double()  # (H, r, L)
    # Σ_h α^h_ij U^h_j as one batched product over keys j: (L, r, H) @ (L, H, E) → (L, r, E);
    # (einsum picks a slower plan for this small H)
    T = (alpha.permute(2, 1, 0) @ block.values.double().permute(1, 0, 2)).permute(1, 0, 2)
    mean_alpha = alpha.mean(0)  # (r, L)
    if block.out_bias is not None:
        T = T + mean_alpha[..., None] * block.out_bias.double()
    T[torch.arange(len(rows)), rows] += block.residual[rows].double()
    if block.post_norm is not None:
        T = _normed(T, block.post_norm, mean_alpha)
    return T


def _normed(T: torch.Tensor, norm: PostNorm, share: torch.Tensor) -> torch.Tensor:
    """Each term through the norm whose scale the whole sum fixes."""
    total = T.sum(1)  # (r, E): the pre-norm sum y_i
    weight = norm.weight.double()
    if norm.rms:
        scale = (total.pow(2).mean(-1) + norm.eps).rsqrt()  # (r,)
        return weight * T * scale[:, None, None]
    centred = T - T.mean(-1, keepdim=True)
    scale = (total.var(-1, unbiased=False) + norm.eps).rsqrt()
    out = weight * centred * scale[:, None, None]
    if norm.bias is not None:
        out = out + share[..., None] * norm.bias.double()
    return out


def rows_per_block(length: int, width: int, budget: int) -> int:
    """Query rows whose terms (rows × L × E float64, with two working copies) fit the budget."""
    per_row = 3 * 8 * max(1, length) * max(1, width)
    return max(1, min(length, budget // per_row))


def contribution_rows(block: BlockTerms, rows: torch.Tensor, budget: int
                      ) -> dict[TokenMethod, torch.Tensor]:
    """Each method's contribution matrix rows (len(rows), L), rows normalized; the terms are
    built a block of rows at a time within `budget` bytes, over the keys those rows can see
    (a causal model's block of rows up to i sees keys up to i: about half the work)."""
    L, E = block.residual.shape
    step = rows_per_block(L, E, budget)
    wide = _float64(block)  # converted once, not per block of rows
    out: dict[TokenMethod, list[torch.Tensor]] = {m: [] for m in CONTRIBUTION_METHODS}
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        seen = wide.maps[:, chunk].sum(0) > 0  # (r, L)
        seen[torch.arange(len(chunk)), chunk] = True
        K = int(seen.any(0).nonzero().max()) + 1  # keys past K are seen by no row here
        T = terms(_keys(wide, K), chunk)  # (r, K, E)
        y = T.sum(1, keepdim=True)  # (r, 1, E)
        check_identity(block, chunk, y[:, 0])
        norms = torch.zeros(len(chunk), L, dtype=T.dtype)
        norms[:, :K] = torch.linalg.vector_norm(T, dim=-1)
        out[TokenMethod.NORMS].append(norms)
        distance = torch.cdist(y, T, p=1)[:, 0]  # (r, K) ‖y_i − T_ij‖₁, fused
        alti = torch.zeros(len(chunk), L, dtype=T.dtype)
        alti[:, :K] = (y[:, 0].abs().sum(-1, keepdim=True) - distance).clamp(min=0)
        # a key the query cannot see has T_ij = 0, so exactly 0 (cdist's rounding aside)
        out[TokenMethod.ALTI].append(torch.where(seen, alti, 0.0))
    return {m: _row_normalized(torch.cat(parts)) for m, parts in out.items()}


def _keys(block: BlockTerms, keys: int) -> BlockTerms:
    """The block with its keys cut to the first `keys` (the residual keeps every row)."""
    if keys == block.maps.shape[-1]:
        return block
    return BlockTerms(block.maps[..., :keys], block.values[:, :keys], block.residual,
                      block.out_bias, block.post_norm, identity_rtol=block.identity_rtol)


def _float64(block: BlockTerms) -> BlockTerms:
    def wide(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.double()

    norm = block.post_norm
    return BlockTerms(block.maps.double(), block.values.double(), block.residual.double(),
                      wide(block.out_bias), None if norm is None else PostNorm(
                          norm.weight.double(), wide(norm.bias), norm.eps, norm.rms),
                      identity_rtol=block.identity_rtol)


def _row_normalized(M: torch.Tensor) -> torch.Tensor:
    total = M.sum(-1, keepdim=True)
    return torch.where(total > 0, M / total.clamp(min=torch.finfo(M.dtype).tiny), 0.0)


def compose(blocks: list[BlockTerms], position: int, budget: int
            ) -> dict[TokenMethod, tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each contribution method's (chain (n + 1, L), per-layer matrices (L, L)) for one output
    position: e_p carried down, each layer's matrix built only for the rows the vector still
    reaches (a causal model's rows ≤ p; the other rows stay 0)."""
    L = blocks[0].residual.shape[0]
    chains: dict[TokenMethod, list[torch.Tensor]] = {}
    matrices: dict[TokenMethod, list[torch.Tensor]] = {m: [] for m in CONTRIBUTION_METHODS}
    for method in CONTRIBUTION_METHODS:
        v = torch.zeros(L, dtype=torch.float64)
        v[position] = 1.0
        chains[method] = [v]
    for block in reversed(blocks):
        reached = torch.zeros(L, dtype=torch.bool)
        for method in CONTRIBUTION_METHODS:
            reached |= chains[method][-1] != 0
        rows = reached.nonzero().flatten()
        computed = contribution_rows(block, rows, budget)
        for method in CONTRIBUTION_METHODS:
            v = chains[method][-1]
            chains[method].append(v[rows] @ computed[method])
            full = torch.zeros(L, L, dtype=torch.float64)
            full[rows] = computed[method]
            matrices[method].append(full)
    return {m: (torch.stack(c[::-1]), matrices[m][::-1]) for m, c in chains.items()}
