"""QK and OV circuits of every head, and Q-, K-, V-composition between heads, in factored form.

Conventions (weights as `nn.Linear` stores them, `(out, in)`; `attnviz.core.layer`):
- head h's score before scaling is x_iᵀ W_QK^h x_j with W_QK^h = W_Q^hᵀ W_K^{g(h)} (E × kdim),
  g(h) the key/value head of h's group (grouped-query and multi-query attention);
- head h writes W_OV^h x_j with W_OV^h = W_O[:, cols(h)] · W_V^{g(h)} (E × vdim);
- a norm scale γ feeding the attention is folded into the reading weights (W diag(γ)) before
  any of this (`fold_scale`); biases are reported apart (`HeadCircuit.bias_norms`).

Every E × E matrix is a product L Rᵀ of two E × d factors (d = head_dim). With QR factors
L = Q_L T_L and R = Q_R T_R (Q orthonormal, T d × d), L Rᵀ = Q_L (T_L T_Rᵀ) Q_Rᵀ: its singular
values are those of the d × d core T_L T_Rᵀ, and ‖L_b R_bᵀ L_a R_aᵀ‖_F = ‖T_Lb (R_bᵀ L_a) T_Raᵀ‖_F.
Nothing E × E is ever formed: a layer costs a QR of each E × d factor and d × d work per head,
a pair of layers one product of their weights and d × d work per pair of heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnviz.compute.qkov.circuits_factors import (  # noqa: F401 - re-exported
    EXACT_FACTOR_NUMEL,
    EXACT_GRAM_NUMEL,
    REFINE_SHARE,
    StoredWeight,
    factor_roots,
    gram_dtype,
    op_threads,
    output_roots,
    peak,  # also for app.circuits' finiteness check
    row_roots,
    small_algebra,
    unit_of,
)

RANK_RTOL = 1e-4  # a singular value counts towards the rank above this share of the largest
EFFECTIVE_SHARE = 0.9  # effective rank: singular values holding this share of the squared norm
BASELINE_DRAWS = 5  # random pairs averaged per composition baseline
BASELINE_SEED = 0
KINDS = ("Q", "K", "V")


@dataclass(frozen=True)
class CircuitWeights:
    """One layer's projections, norm scale folded in, in (out, in) orientation (kept for
    composition), each divided by its power-of-two unit (`StoredWeight.unit`)."""

    W_q: torch.Tensor  # (H·d, E)
    W_k: torch.Tensor  # (H_kv·d, kdim)
    W_v: torch.Tensor  # (H_kv·d, vdim)
    W_o: torch.Tensor  # (E, H·d)
    num_heads: int  # H
    num_kv_heads: int  # H_kv
    head_dim: int  # d


def fold_scale(W: torch.Tensor, gamma: torch.Tensor | None) -> torch.Tensor:
    """W diag(γ): a norm's scale folded into a weight that reads its output (columns × γ)."""
    return W if gamma is None else W * gamma.to(W.dtype)[None, :]


@dataclass(frozen=True)
class Spectrum:
    """One circuit's size and shape: its singular values, descending."""

    singular_values: tuple[float, ...]  # all d of them, descending
    norm: float  # Frobenius norm: √(Σ σ²) over all d singular values
    rank: int  # singular values above RANK_RTOL × the largest
    effective_rank: int  # fewest singular values holding EFFECTIVE_SHARE of Σ σ²

    def to_json(self) -> dict[str, object]:
        return {"norm": self.norm, "rank": self.rank, "effective_rank": self.effective_rank,
                "singular_values": list(self.singular_values)}


@dataclass(frozen=True)
class HeadCircuit:
    head: int
    kv_head: int
    qk: Spectrum
    ov: Spectrum
    # Σ Re λ / Σ |λ| over the eigenvalues of W_OV (those of the d × d W_V^g W_O[:, cols(h)]):
    # +1 all positive (the head copies what it reads), −1 all negative; None when vdim ≠ E
    copying: float | None
    bias_norms: dict[str, float]  # ‖b_Q^h‖, ‖b_K^g‖, ‖b_V^g‖ where the layer has them


@dataclass
class LayerFactors:
    """What composition needs of a layer: the d × d factors T (TᵀT = FᵀF for each E × d
    factor F) and, where kept, the folded weights themselves."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Each weight in its own unit (`StoredWeight.unit`), as `weights` holds it: composition
    # scores are ratios in which the units cancel, so none of them is undone here.
    T_q: torch.Tensor  # (H, d, d) float64, of W_Q^hᵀ
    T_k: torch.Tensor  # (H_kv, d, d), of W_K^gᵀ
    T_v: torch.Tensor  # (H_kv, d, d), of W_V^gᵀ
    T_o: torch.Tensor  # (H, d, d), of W_O[:, cols(h)]
    qk_norm: torch.Tensor  # (H,) ‖W_QK^h‖_F in units of unit_q · unit_k
    ov_norm: torch.Tensor  # (H,) ‖W_OV^h‖_F in units of unit_o · unit_v
    qk_rank: tuple[int, ...]
    ov_rank: tuple[int, ...]
    widths: tuple[int, int, int, int]  # (E out, E read by W_Q, kdim, vdim)
    weights: CircuitWeights | None = None  # kept only when composition needs them

    @property
    def kv_of(self) -> torch.Tensor:
        return torch.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)


def spectrum(singular_values: torch.Tensor) -> Spectrum:
    """A circuit's summary from all of its singular values (descending)."""
    s = singular_values.double()
    squares = s.square()
    total = float(squares.sum())
    largest = float(s[0]) if s.numel() else 0.0
    rank = int((s > RANK_RTOL * largest).sum()) if largest > 0 else 0
    if total > 0:
        share = torch.cumsum(squares, 0) / total
        effective = int((share < EFFECTIVE_SHARE - 1e-12).sum()) + 1
    else:
        effective = 0
    return Spectrum(tuple(float(v) for v in s), total ** 0.5, rank,
                    min(effective, rank))


def spectra(singular_values: torch.Tensor, unit: float = 1.0) -> list[Spectrum]:
    """`spectrum` of each row of (n, d) singular values (descending), computed for all at once,
    of the circuits `unit` × those the values belong to: ranks and shares from the values as
    given (of order 1, `StoredWeight.unit`), singular values and norms times `unit` in float64."""
    s = singular_values.double()
    squares = s.square()
    total = squares.sum(dim=1)  # (n,)
    largest = s[:, 0] if s.shape[1] else torch.zeros(len(s), dtype=s.dtype)
    rank = torch.where(largest > 0, (s > RANK_RTOL * largest[:, None]).sum(dim=1), 0)
    share = torch.cumsum(squares, 1) / torch.where(total > 0, total, 1.0)[:, None]
    effective = torch.where(total > 0, (share < EFFECTIVE_SHARE - 1e-12).sum(dim=1) + 1, 0)
    return [Spectrum(tuple(v * unit for v in values), norm ** 0.5 * unit, r, min(e, r))
            for values, norm, r, e in
            zip(s.tolist(), total.tolist(), rank.tolist(), effective.tolist(), strict=True)]


WeightReader = Callable[[str], StoredWeight]  # "q", "k", "v", "o" → the weight and its γ


def layer_circuits(read: WeightReader, heads: tuple[int, int, int],
                   biases: dict[str, torch.Tensor | None] | None = None,
                   keep: bool = False, device: torch.device | str = "cpu",
                   ) -> tuple[LayerFactors, list[HeadCircuit]]:
    """Every head's QK and OV circuit of one layer, and the factors composition reuses.

    `read` is asked for W_Q, W_K, W_V and W_O one at a time, each converted to float32 (γ
    folded) a few heads at a time, so beside the stored weights at most W_V and a chunk are
    held as float32 (all four weights with `keep`, for composition)."""
    H, Hkv, d = heads
    kv = torch.arange(H) // (H // Hkv)
    kept: dict[str, torch.Tensor] = {}
    units: dict[str, float] = {}  # each weight is converted in units of a power of two

    def stored(name: str) -> StoredWeight:
        W = read(name)
        units[name] = unit_of(peak(W))
        W = StoredWeight(W.tensor, W.scale, units[name])
        if keep or name == "v":  # W_V meets every W_O chunk (copying); composition keeps all
            kept[name] = W.as_float(device=device)
            return StoredWeight(kept[name])
        return W

    W_q = stored("q")
    widths_q = W_q.tensor.shape[1]
    T_q = row_roots(W_q, H, d, device)  # (H, d, d)
    del W_q
    W_k = stored("k")
    kdim = W_k.tensor.shape[1]
    T_k = row_roots(W_k, Hkv, d, device)  # (H_kv, d, d)
    del W_k
    W_v = stored("v").tensor
    T_v = row_roots(StoredWeight(W_v), Hkv, d, device)
    W_o = stored("o")
    out_width = W_o.tensor.shape[0]
    T_o, blocks = output_roots(W_o, W_v if W_v.shape[1] == out_width else None, H, Hkv, d,
                               device)
    del W_o
    qk_sv = core_singular_values(T_q @ T_k[kv].transpose(1, 2))  # (H, d)
    ov_sv = core_singular_values(T_o @ T_v[kv].transpose(1, 2))
    copying = None if blocks is None else _copying(blocks)
    # the cores are in units of the weights' units: their product takes them out (exact)
    qk, ov = spectra(qk_sv, units["q"] * units["k"]), spectra(ov_sv, units["o"] * units["v"])
    circuits = [HeadCircuit(h, int(kv[h]), qk[h], ov[h],
                            None if copying is None else copying[h],
                            _bias_norms(biases or {}, h, int(kv[h]), d)) for h in range(H)]
    weights = CircuitWeights(kept["q"], kept["k"], kept["v"], kept["o"], H, Hkv, d) if keep \
        else None
    factors = LayerFactors(H, Hkv, d, T_q, T_k, T_v, T_o, qk_sv.norm(dim=1), ov_sv.norm(dim=1),
                           tuple(c.qk.rank for c in circuits), tuple(c.ov.rank for c in circuits),
                           (out_width, widths_q, kdim, W_v.shape[1]), weights)
    return factors, circuits


def core_singular_values(cores: torch.Tensor) -> torch.Tensor:
    """(n, d) singular values, descending, of (n, d, d) float64 cores C: the square roots of
    the eigenvalues of C Cᵀ, 20 % faster than an SVD; each within √ε ≈ 1.5e-8 of the largest
    (RANK_RTOL is 1e-4)."""
    with small_algebra():
        values = torch.linalg.eigvalsh(cores @ cores.transpose(1, 2))  # ascending
    return values.clamp_min(0).sqrt().flip(1)


def _copying(blocks: torch.Tensor) -> list[float]:
    """Per head Σ Re λ / Σ |λ| over the eigenvalues of its (d × d) W_V^g W_O[:, cols(h)], which
    are the nonzero eigenvalues of W_OV^h."""
    with small_algebra():
        eig = torch.linalg.eigvals(blocks)  # (H, d)
    size = eig.abs().sum(dim=1)
    return torch.where(size > 0, eig.real.sum(dim=1) / size.clamp_min(1e-300), 0.0).tolist()


def _bias_norms(biases: dict[str, torch.Tensor | None], h: int, g: int,
                d: int) -> dict[str, float]:
    found = {}
    for name, index in (("q", h), ("k", g), ("v", g)):
        bias = biases.get(name)
        if bias is not None:
            found[name] = float(bias[index * d:(index + 1) * d].double().norm())
    return found


@dataclass(frozen=True)
class Composition:
    """One kind of composition of a later layer's heads on an earlier layer's heads."""

    kind: str  # "Q", "K" or "V"
    scores: torch.Tensor  # (H_later, H_earlier) float64
    baseline: torch.Tensor  # (H_later, H_earlier): random matrices of the same shapes and ranks


def compose(later: LayerFactors, earlier: LayerFactors,
            kinds: tuple[str, ...] = KINDS) -> list[Composition]:
    """Q-, K- and V-composition of every head of `later` on every head of `earlier` (both kept
    their weights): K ‖W_QK^b W_OV^a‖_F, Q ‖(W_OV^a)ᵀ W_QK^b‖_F, V ‖W_OV^b W_OV^a‖_F, each
    divided by the product of the two circuits' norms (b a head of `later`, a of `earlier`)."""
    b, a = later.weights, earlier.weights
    if b is None or a is None:
        raise ValueError("composition needs both layers' weights (keep=True)")
    for kind in kinds:
        if not composable(kind, later, earlier):
            raise ValueError(f"{kind}-composition: {not_composable(kind, later, earlier)}")
    kv_b = later.kv_of
    T_va = earlier.T_v[earlier.kv_of]  # (H_a, d_a, d_a)
    d_b, d_a, H_a = b.head_dim, a.head_dim, a.num_heads
    found = []
    for kind in kinds:
        if kind == "K":  # T_q^b (W_K^{g(b)} W_O^a) T_v^{g(a)}ᵀ
            cross = _blocks(b.W_k, a.W_o, b.num_kv_heads, (d_b, d_a), H_a)[kv_b]
            norms = _core_norms(later.T_q, cross, T_va) / later.qk_norm[:, None]
        elif kind == "Q":  # T_v^{g(a)} (W_Q^b W_O^a)ᵀ T_k^{g(b)}ᵀ, norm of its transpose
            cross = _blocks(b.W_q, a.W_o, b.num_heads, (d_b, d_a), H_a)
            norms = _core_norms(later.T_k[kv_b], cross, T_va) / later.qk_norm[:, None]
        else:  # V: T_o^b (W_V^{g(b)} W_O^a) T_v^{g(a)}ᵀ
            cross = _blocks(b.W_v, a.W_o, b.num_kv_heads, (d_b, d_a), H_a)[kv_b]
            norms = _core_norms(later.T_o, cross, T_va) / later.ov_norm[:, None]
        scores = norms / earlier.ov_norm[None, :]
        found.append(Composition(kind, scores, _baselines(kind, later, earlier)))
    return found


# what each kind of composition reads the earlier layer's output with: the index into
# LayerFactors.widths of the later layer's input width that must equal the earlier one's output
READ_WIDTH = {"Q": 1, "K": 2, "V": 3}


def composable(kind: str, later: LayerFactors, earlier: LayerFactors) -> bool:
    """Whether `later`'s W_Q (Q), W_K (K) or W_V (V) reads vectors as wide as `earlier` writes:
    layers of different widths (Swin's stages) are not in one residual stream."""
    return later.widths[READ_WIDTH[kind]] == earlier.widths[0]


def not_composable(kind: str, later: LayerFactors, earlier: LayerFactors) -> str:
    """Why not, e.g. "not composable: width 32 vs 16": what `later` reads vs what `earlier`
    writes."""
    return f"not composable: width {later.widths[READ_WIDTH[kind]]} vs {earlier.widths[0]}"


def _blocks(W_read: torch.Tensor, W_o: torch.Tensor, heads: int, dims: tuple[int, int],
            heads_a: int) -> torch.Tensor:
    """W_read (heads·d_b, E) @ W_o (E, H_a·d_a) → (heads, H_a, d_b, d_a) float64 blocks."""
    d_b, d_a = dims
    dtype = gram_dtype(W_o)
    product = (W_read.to(dtype) @ W_o.to(dtype)).double().cpu()  # (heads·d_b, H_a·d_a)
    return product.reshape(heads, d_b, heads_a, d_a).permute(0, 2, 1, 3)


def _core_norms(left: torch.Tensor, cross: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """‖left[b] · cross[b, a] · right[a]ᵀ‖_F for all (b, a): left (H_b, d_b, d_b), cross
    (H_b, H_a, d_b, d_a), right (H_a, d_a, d_a)."""
    with small_algebra():
        inner = torch.einsum("bij,bajk->baik", left, cross)  # (H_b, H_a, d, d)
        return torch.einsum("baik,alk->bail", inner, right).flatten(2).norm(dim=2)


def _baselines(kind: str, later: LayerFactors, earlier: LayerFactors) -> torch.Tensor:
    """(H_b, H_a): each pair's baseline from its circuits' shapes and ranks (cached)."""
    out_b, reads_b, kdim_b, vdim_b = later.widths
    out_a, _, _, vdim_a = earlier.widths
    if kind in ("K", "Q"):
        shape_b, ranks_b = (reads_b, kdim_b), later.qk_rank
    else:
        shape_b, ranks_b = (out_b, vdim_b), later.ov_rank
    table = torch.empty(later.num_heads, earlier.num_heads, dtype=torch.float64)
    for i, r_b in enumerate(ranks_b):
        for j, r_a in enumerate(earlier.ov_rank):
            table[i, j] = random_score(kind, (shape_b, r_b), ((out_a, vdim_a), r_a))
    return table


_BASELINE_CACHE: dict[tuple[object, ...], float] = {}


# a random circuit's (shape, rank): a Gaussian matrix of that shape and rank
CircuitShape = tuple[tuple[int, int], int]


def random_score(kind: str, later: CircuitShape, earlier: CircuitShape,
                 draws: int = BASELINE_DRAWS, seed: int = BASELINE_SEED) -> float:
    """The mean composition score of `draws` random pairs: the later circuit a Gaussian
    (shape_b, rank rank_b) matrix G1 G2ᵀ, the earlier one (shape_a, rank_a) G3 G4ᵀ, seeded."""
    (shape_b, rank_b), (shape_a, rank_a) = later, earlier
    key = (kind, shape_b, shape_a, rank_b, rank_a, draws, seed)
    if key in _BASELINE_CACHE:
        return _BASELINE_CACHE[key]
    if rank_a == 0 or rank_b == 0:
        return 0.0
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(draws):
        L_b, R_b = (torch.randn(n, rank_b, generator=gen, dtype=torch.float64) for n in shape_b)
        L_a, R_a = (torch.randn(n, rank_a, generator=gen, dtype=torch.float64) for n in shape_a)
        total += pair_score(kind, (L_b, R_b), (L_a, R_a))
    _BASELINE_CACHE[key] = total / draws
    return _BASELINE_CACHE[key]


def pair_score(kind: str, later: tuple[torch.Tensor, torch.Tensor],
               earlier: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The composition score of two circuits given as factors (L, R), circuit = L Rᵀ, in
    factored form: K and V ‖X Y‖ with X = later, Y = earlier; Q ‖Yᵀ X‖."""
    (L_b, R_b), (L_a, R_a) = later, earlier
    T_lb, T_rb, T_la, T_ra = (factor_roots(F[None])[0] for F in (L_b, R_b, L_a, R_a))
    if kind == "Q":  # Yᵀ X = R_a (L_aᵀ L_b) R_bᵀ
        norm = torch.linalg.norm(T_ra @ (L_a.T @ L_b) @ T_rb.T)
    else:  # X Y = L_b (R_bᵀ L_a) R_aᵀ
        norm = torch.linalg.norm(T_lb @ (R_b.T @ L_a) @ T_ra.T)
    size = torch.linalg.norm(T_lb @ T_rb.T) * torch.linalg.norm(T_la @ T_ra.T)
    return float(norm / size)
