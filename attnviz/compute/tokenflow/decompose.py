"""Residual- and norm-aware token-to-token contributions of one attention block (Kobayashi et
al. 2021; ALTI, Ferrando et al. 2022), and their composition across layers.

An attention block's output for token i is a sum of one term per source token j,

    y_i = Σ_j T_ij,   T_ij = Σ_h α^h_ij U^h_j + ᾱ_ij b_O + [i = j] r_i,

U^h_j = W_O[:, cols(h)] (W_V^h x_j + b_V^h) what head h writes from token j, ᾱ_ij the heads'
mean weight (the output bias shared as attention shares the rest: Σ_j ᾱ_ij = 1), r_i the
residual. A norm after the residual (post-LN: BERT, BART) is linear once its per-token scale is
fixed: LN(Σ_j T_ij) = Σ_j γ ⊙ (T_ij − mean(T_ij)) / σ_i + ᾱ_ij β, with σ_i the scale of the
whole sum, so the identity Σ_j T_ij = y_i holds after it too (an RMSNorm: γ ⊙ T_ij / rms_i).
A norm on the attention sublayer's output before the residual (Gemma 2/3, OLMo-2: x + N(attn))
is frozen the same way, its scale fixed by the whole attention output a_i = y_i − r_i: each
term's attention part goes through it, the residual does not.

Kobayashi et al. 2021 ("norms"): c_ij = ‖T_ij‖₂, each row normalized.
ALTI: c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_ij‖₁), each row normalized.
Across layers the contributions compose like rollout (a row vector carried down).

Shapes: maps (H, L, L) [head, query, key]; values U (H, L, E); residual (L, E); one sentence.
Terms are built for a block of query rows at a time: (rows, L, E) floats, sized by the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    out_norm: PostNorm | None = None  # a norm on the attention output, before the residual

    def __post_init__(self) -> None:
        # one frozen norm per block: the Gram form scales the attention terms by one s_i
        assert self.post_norm is None or self.out_norm is None


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
    if block.out_norm is not None:  # its scale fixed by the attention output alone
        T = _normed(T, block.out_norm, mean_alpha)
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


def contribution_rows(block: BlockTerms, rows: torch.Tensor, budget: int,
                      methods: tuple[TokenMethod, ...] = CONTRIBUTION_METHODS
                      ) -> dict[TokenMethod, torch.Tensor]:
    """Each asked method's contribution matrix rows (len(rows), L), rows normalized: the norms
    from per-key Gram matrices (no term is formed), ALTI from the terms themselves."""
    out = {}
    if TokenMethod.NORMS in methods:
        out[TokenMethod.NORMS] = _row_normalized(norm_rows(block, rows, budget))
    if TokenMethod.ALTI in methods:
        out[TokenMethod.ALTI] = _row_normalized(alti_rows(block, rows, budget))
    return out


def alti_rows(block: BlockTerms, rows: torch.Tensor, budget: int) -> torch.Tensor:
    """(len(rows), L) float64: max(0, ‖y_i‖₁ − ‖y_i − T_ij‖₁), not normalized. An L1 distance
    has no Gram form, so the terms are built, a block of rows at a time within `budget` bytes,
    over the keys those rows can see (a causal model's block of rows up to i sees keys up to
    i: about half the work): O(L²·E) element-wise per layer."""
    L, E = block.residual.shape
    step = rows_per_block(L, E, budget)
    wide = _float64(block)  # converted once, not per block of rows
    parts = []
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        seen = wide.maps[:, chunk].sum(0) > 0  # (r, L)
        seen[torch.arange(len(chunk)), chunk] = True
        K = int(seen.any(0).nonzero().max()) + 1  # keys past K are seen by no row here
        T = terms(_keys(wide, K), chunk)  # (r, K, E)
        y = T.sum(1, keepdim=True)  # (r, 1, E)
        check_identity(block, chunk, y[:, 0])
        distance = torch.cdist(y, T, p=1)[:, 0]  # (r, K) ‖y_i − T_ij‖₁, fused
        alti = torch.zeros(len(chunk), L, dtype=T.dtype)
        alti[:, :K] = (y[:, 0].abs().sum(-1, keepdim=True) - distance).clamp(min=0)
        # a key the query cannot see has T_ij = 0, so exactly 0 (cdist's rounding aside)
        parts.append(torch.where(seen, alti, 0.0))
    return torch.cat(parts)


# ---- norms through per-key Gram matrices ------------------------------------------------------
#
# Off the diagonal (j ≠ i) the term is T_ij = Σ_p a_ij,p w_j,p: per key j a few vectors w_j,p,
# the same for every query row, weighted by coefficients a_ij,p made of attention weights:
#   w_j,h = N(U^h_j + b_O / H)   a_ij,h = s_i α^h_ij   (ᾱ_ij b_O = Σ_h α^h_ij b_O / H)
#   w_j,H = β                    a_ij,H = ᾱ_ij          (a post-LN's bias, shared like b_O)
# with N the norm's linear part (γ ⊙ centring; γ for RMSNorm; the identity without a norm) and
# s_i the scale the whole row's sum fixes (1 without a norm). So ‖T_ij‖² = a_ijᵀ G_j a_ij with
# G_j = W_j W_jᵀ the (P, P) Gram matrix of key j's vectors: per layer O(L·P²·E) for the Gram
# matrices and O(L²·P²) for the norms, where the terms take O(L²·E) element-wise. The sums run
# in float64 (a tiny negative square, rounding, is clamped to 0); the diagonal (j = i, which
# also carries the residual) is built directly: L vectors.

NORM_ROWS_MAX = 256  # rows per block: fewer, larger array operations, each still small


@dataclass(frozen=True)
class KeyGrams:
    """One block's per-key vectors and their Gram matrices (float64)."""

    vectors: torch.Tensor  # (L, P, E) w_j,p
    grams: torch.Tensor  # (P, P, L) G_j[p, q], keys last (broadcast along a row's keys)
    values: torch.Tensor  # (H, L, E) U^h_j + b_O / H before the norm: the row sums y_i
    shares_beta: bool  # whether p = H is the post-LN bias β (coefficient ᾱ_ij, unscaled)


def linear_part(x: torch.Tensor, norm: PostNorm | None) -> torch.Tensor:
    """N(x): the post-norm without its per-row scale and its bias (x itself without one)."""
    if norm is None:
        return x
    if not norm.rms:
        x = x - x.mean(-1, keepdim=True)
    return norm.weight.double() * x


def key_grams(block: BlockTerms) -> KeyGrams:
    H = block.maps.shape[0]
    values = block.values.double()
    if block.out_bias is not None:
        values = values + block.out_bias.double() / H
    norm = _frozen_norm(block)
    vectors = linear_part(values, norm).transpose(0, 1)  # (L, H, E)
    beta = None if norm is None or norm.rms or norm.bias is None else norm.bias.double()
    if beta is not None:
        vectors = torch.cat([vectors, beta.expand(vectors.shape[0], 1, -1)], 1)
    grams = (vectors @ vectors.transpose(1, 2)).permute(1, 2, 0).contiguous()
    return KeyGrams(vectors, grams, values, beta is not None)


def _frozen_norm(block: BlockTerms) -> PostNorm | None:
    """The norm whose per-row scale multiplies the attention terms (after or before the
    residual sum), None without one."""
    return block.post_norm if block.post_norm is not None else block.out_norm


def norm_rows_per_block(length: int, heads: int, budget: int) -> int:
    """Query rows whose working set fits the budget (per row and key, float64: the scaled
    coefficients (H + 1 with a post-LN's β), the running sums, the result and its copy into
    the rows; float32: the maps' slice), at most NORM_ROWS_MAX."""
    per_row = max(1, length) * (8 * (heads + 4) + 4 * heads)
    return max(1, min(length, NORM_ROWS_MAX, budget // per_row))


def norm_rows(block: BlockTerms, rows: torch.Tensor, budget: int) -> torch.Tensor:
    """(len(rows), L) float64: ‖T_ij‖₂ for the query rows `rows` (not normalized), from the
    per-key Gram matrices, a block of rows at a time within `budget` bytes."""
    keys = key_grams(block)
    H, L, _ = block.maps.shape
    step = norm_rows_per_block(L, H, budget)
    residual = linear_part(block.residual.double(), block.post_norm)
    # without a norm the row sums serve the identity check alone: float32 is exact enough for
    # a tolerance of 1e-5 or more (float32's rounding over L·H terms stays near 1e-6)
    narrow = keys.values.float() if block.identity_rtol >= 1e-5 else keys.values
    out = torch.zeros(len(rows), L, dtype=torch.float64)
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        r, alpha = len(chunk), _row_maps(block.maps, chunk)  # (H, r, K) float32, as given
        K = alpha.shape[-1]
        scale = _check_and_scale(block, keys, narrow, alpha, chunk)
        if scale is None:
            coeff = list(alpha)  # float32 weights; the sums below run in float64
        else:
            coeff = list(alpha.double() * scale[:, None])
        if keys.shares_beta:
            coeff.append(alpha.double().mean(0))
        out[start:start + r, :K] = quadratic_norms(coeff, keys.grams[..., :K])
        # the self term j = i, which also carries the residual, built directly
        own_coeff = torch.stack([c[torch.arange(r), chunk] for c in coeff], -1).double()
        own = (own_coeff[..., None] * keys.vectors[chunk]).sum(1)
        # the residual is scaled by a norm after the sum, not by one on the attention output
        if scale is not None and block.post_norm is not None:
            own = own + residual[chunk] * scale[:, None]
        else:
            own = own + residual[chunk]
        out[torch.arange(start, start + r), chunk] = torch.linalg.vector_norm(own, dim=-1)
    return out


def _row_maps(maps: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """(H, r, K): the maps' rows `chunk` (a view when they are consecutive, as a causal
    model's usually are), cut after the last key any of them reads: a block of rows up to i
    of a causal model is computed over keys up to i alone, about half the work."""
    first = int(chunk[0])
    if torch.equal(chunk, torch.arange(first, first + len(chunk))):
        rows = maps[:, first:first + len(chunk)]
    else:
        rows = maps.index_select(1, chunk)
    K = int(chunk.max()) + 1
    if K < maps.shape[-1] and bool(rows[..., K:].any()):
        K = maps.shape[-1]
    return rows[..., :K]


def _check_and_scale(block: BlockTerms, keys: KeyGrams, narrow: torch.Tensor,
                     alpha: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor | None:
    """The rows' sums y_i = Σ_h α^h_i· U'^h + r_i against the block's own output, and the
    post-norm's scale s_i they fix (None without a norm). With a norm the sums run in float64
    (s_i scales the norms); without one they serve the identity check alone (`narrow`: the
    values in float32 where the check's tolerance allows)."""
    K = alpha.shape[-1]
    norm = block.post_norm
    if block.out_norm is not None:
        attn = torch.bmm(alpha.double(), keys.values[:, :K]).sum(0)  # a_i, before the norm
        scale = _row_scale(attn, block.out_norm)
        y = _normed_sum(attn, scale, alpha.double().mean(0).sum(-1), block.out_norm)
        check_identity(block, chunk, y + block.residual[chunk].double())
        return scale
    if norm is None:
        if block.output is not None:
            y = torch.bmm(alpha.to(narrow.dtype), narrow[:, :K]).sum(0).double()
            y = y + block.residual[chunk].double()
            check_identity(block, chunk, y)
        return None
    y = torch.bmm(alpha.double(), keys.values[:, :K]).sum(0) + block.residual[chunk].double()
    scale = _row_scale(y, norm)
    check_identity(block, chunk, _normed_sum(y, scale, alpha.double().mean(0).sum(-1), norm))
    return scale


def quadratic_norms(coeff: list[torch.Tensor], grams: torch.Tensor) -> torch.Tensor:
    """(r, K) float64: sqrt(a_ijᵀ G_j a_ij) for the P coefficient arrays a_·,·,p (r, K) and
    the Gram matrices G (P, P, K): Σ_p a_p (G_pp a_p + 2 Σ_{q>p} G_pq a_q), P(P + 1)/2
    multiply-adds over (r, K) arrays (the coefficients may be float32: each product is
    float64)."""
    total: torch.Tensor | None = None
    for p in range(len(coeff)):
        z = coeff[p] * grams[p, p]
        for q in range(p + 1, len(coeff)):
            z.addcmul_(coeff[q], grams[p, q], value=2.0)
        total = z.mul_(coeff[p]) if total is None else total.addcmul_(z, coeff[p])
    assert total is not None
    return total.clamp_(min=0.0).sqrt_()


def _row_scale(y: torch.Tensor, norm: PostNorm | None) -> torch.Tensor | None:
    """s_i (r,): the post-norm's scale, fixed by each row's whole pre-norm sum y_i."""
    if norm is None:
        return None
    if norm.rms:
        return (y.pow(2).mean(-1) + norm.eps).rsqrt()
    return (y.var(-1, unbiased=False) + norm.eps).rsqrt()


def _normed_sum(y: torch.Tensor, scale: torch.Tensor | None, share: torch.Tensor,
                norm: PostNorm | None) -> torch.Tensor:
    """Σ_j T_ij after the norm: s_i N(y_i) + (Σ_j ᾱ_ij) β."""
    if norm is None or scale is None:
        return y
    out = linear_part(y, norm) * scale[:, None]
    if norm.bias is not None and not norm.rms:
        out = out + share[:, None] * norm.bias.double()
    return out


def _keys(block: BlockTerms, keys: int) -> BlockTerms:
    """The block with its keys cut to the first `keys` (the residual keeps every row)."""
    if keys == block.maps.shape[-1]:
        return block
    return replace(block, maps=block.maps[..., :keys], values=block.values[:, :keys],
                   output=None)


def _float64(block: BlockTerms) -> BlockTerms:
    def wide(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.double()

    def wide_norm(norm: PostNorm | None) -> PostNorm | None:
        return None if norm is None else PostNorm(norm.weight.double(), wide(norm.bias),
                                                  norm.eps, norm.rms)

    return replace(block, maps=block.maps.double(), values=block.values.double(),
                   residual=block.residual.double(), out_bias=wide(block.out_bias),
                   post_norm=wide_norm(block.post_norm), out_norm=wide_norm(block.out_norm),
                   output=None)


def _row_normalized(M: torch.Tensor) -> torch.Tensor:
    """Each row over its sum; a row of zeros (M ≥ 0: its sum is 0 alone) stays 0."""
    return M / M.sum(-1, keepdim=True).clamp(min=torch.finfo(M.dtype).tiny)


def compose(blocks: list[BlockTerms], position: int, budget: int,
            methods: tuple[TokenMethod, ...] = CONTRIBUTION_METHODS, keep: bool = True
            ) -> dict[TokenMethod, tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each asked contribution method's (chain (n + 1, L), per-layer matrices (L, L)) for one
    output position: e_p carried down, each layer's matrix built only for the rows the vector still
    reaches (a causal model's rows ≤ p; the other rows stay 0); `keep` False: no matrices,
    the chains alone."""
    L = blocks[0].residual.shape[0]
    asked = tuple(m for m in CONTRIBUTION_METHODS if m in methods)
    chains: dict[TokenMethod, list[torch.Tensor]] = {}
    matrices: dict[TokenMethod, list[torch.Tensor]] = {m: [] for m in asked}
    for method in asked:
        v = torch.zeros(L, dtype=torch.float64)
        v[position] = 1.0
        chains[method] = [v]
    for block in reversed(blocks):
        reached = torch.zeros(L, dtype=torch.bool)
        for method in asked:
            reached |= chains[method][-1] != 0
        rows = reached.nonzero().flatten()
        computed = contribution_rows(block, rows, budget, asked)
        for method in asked:
            v = chains[method][-1]
            chains[method].append(v[rows] @ computed[method])
            if keep:
                full = torch.zeros(L, L, dtype=torch.float64)
                full[rows] = computed[method]
                matrices[method].append(full)
    return {m: (torch.stack(c[::-1]), matrices[m][::-1]) for m, c in chains.items()}
