"""The d × d roots of each head's E × d factors, read in chunks of heads (compute/qkov/circuits.py).

A head's every circuit number depends on its factor F (E × d) only through FᵀF, so each factor
is replaced by a d × d T with TᵀT = FᵀF. The weights are read a few heads at a time: each
chunk is converted to float32 with the norm scale γ folded in, its
heads' Grams taken while it is in cache, and dropped; nothing larger than a chunk (or, for the
copying blocks, W_V) is held beside the stored weight.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Grams of factors with up to this many elements per tensor accumulate in float64 (exact to
# float64 rounding for float32/bf16 weights); larger ones in float32 (≈ 1e-6 relative), where
# a float64 product would cost 2-3× the time on a CPU.
EXACT_GRAM_NUMEL = 1 << 21
# Each head's factor of up to this many elements gets a float64 Gram; larger ones a float32 Gram
# refined in float64 where its eigenvalues are small (`_refined`): as exact, 3-5× faster.
EXACT_FACTOR_NUMEL = 1 << 16
HEAD_CHUNK = 4  # heads converted and multiplied at once: bounds the float32 copies to 4 heads
# Eigenvalues of a float32 Gram below this share of the largest are recomputed in float64.
REFINE_SHARE = 1e-2


_THREADS_LOCK = threading.Lock()
_small_users = [0, 0]  # [threads inside small_algebra, the thread count they replaced]


@contextlib.contextmanager
def small_algebra() -> Iterator[None]:
    """One thread for batches of d × d factorizations: LAPACK gains nothing from threads on
    128 × 128 matrices, and on a busy machine their spinning made them 50-100× slower.
    Safe when layers are computed on several threads (`op_threads`): the last one out
    restores the count the first one in found."""
    with _THREADS_LOCK:
        if _small_users[0] == 0:
            _small_users[1] = torch.get_num_threads()
            torch.set_num_threads(1)
        _small_users[0] += 1
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _small_users[0] -= 1
            if _small_users[0] == 0:
                torch.set_num_threads(_small_users[1])


@contextlib.contextmanager
def op_threads(count: int) -> Iterator[None]:
    """torch's threads per operation set to `count` (threads started inside take it too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gram_dtype(W: torch.Tensor) -> torch.dtype:
    return torch.float64 if W.numel() <= EXACT_GRAM_NUMEL else torch.float32


# A power of two this far from 1 (2^±100) would leave float32's range as a multiplier
# (2^±126): such units are applied in float64 before the float32 conversion.
FLOAT32_SAFE_EXPONENT = 100


@dataclass(frozen=True)
class StoredWeight:
    """A weight as the checkpoint stores it (any float dtype, (out, in), on any device), the
    norm scale γ to fold into its columns on conversion (None: none), and the power of two
    `unit` it is converted in units of (`unit_of`).

    Why the unit: a float32 Gram squares the weights, so weights of scale 1e-26 underflowed to
    a zero Gram (rank 0, norm 0) and weights of 1e20 overflowed, where float64 gives full rank.
    Converted as W diag(γ) / unit, the largest entry is in [1, 2): every float32 product is
    far from under- and overflow, and dividing by a power of two is exact, so the numbers are
    those of the weights at scale 1 times a known factor (undone in float64, `layer_circuits`).
    """

    tensor: torch.Tensor
    scale: torch.Tensor | None = None
    unit: float = 1.0

    def as_float(self, rows: slice = slice(None), cols: slice = slice(None),
                 device: torch.device | str = "cpu") -> torch.Tensor:
        """W[rows, cols] diag(γ[cols]) / unit in float32 on `device`."""
        W = self.tensor[rows, cols].to(device)
        inverse = 1.0 / self.unit  # a power of two: exact
        if abs(math.frexp(inverse)[1]) > FLOAT32_SAFE_EXPONENT or W.dtype == torch.float64:
            return self._as_float64(W, cols, inverse)
        if W.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            W = W.float()
        if self.scale is None:
            if inverse == 1.0:
                return W.float()
            return W.float().mul_(inverse) if W.dtype != torch.float32 else W * inverse
        # γ / unit in float64, then float32: exact while it stays in float32's normal range
        scale = (self.scale[cols].to(device=device, dtype=torch.float64) * inverse).float()
        # two vectorized passes: 25-40 % faster than one mixed-dtype multiplication, same bits
        return W.float().mul_(scale) if W.dtype != torch.float32 else W * scale

    def _as_float64(self, W: torch.Tensor, cols: slice, inverse: float) -> torch.Tensor:
        """The rare path: units beyond float32's range, or float64 weights (whose tiny or huge
        values float32 cannot hold before the unit is applied)."""
        W = W.double()
        if self.scale is not None:
            W = W * self.scale[cols].to(device=W.device, dtype=torch.float64)
        return (W * inverse).float()


PEAK_ROWS = 1024  # rows read at once by `column_peaks`: bounds its copy to a block of rows


def column_peaks(tensor: torch.Tensor) -> torch.Tensor:
    """max |W[:, j]| per column, float64, a block of rows at a time (no full-size copy); NaN
    where a column holds a NaN (amax propagates it), inf where it holds an Inf."""
    peaks = torch.zeros(tensor.shape[-1], dtype=torch.float64, device=tensor.device)
    for start in range(0, tensor.shape[0], PEAK_ROWS):
        block = tensor[start:start + PEAK_ROWS]
        if block.dtype not in _REDUCIBLE:  # float8 has no abs/amax kernels on a CPU
            block = block.float()
        peaks = torch.maximum(peaks, block.abs().amax(dim=0).double())  # NaN propagates
    return peaks


_REDUCIBLE = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def peak(W: StoredWeight) -> float:
    """max |W diag(γ)| in float64 (the stored weights' columns' peaks times |γ|), for `unit_of`;
    NaN or inf for a non-finite weight."""
    columns = column_peaks(W.tensor if W.tensor.dim() == 2 else W.tensor.reshape(1, -1))
    if W.scale is not None:
        columns = columns * W.scale.to(device=columns.device, dtype=torch.float64).abs()
    return float(columns.amax()) if columns.numel() else 0.0


def unit_of(largest: float) -> float:
    """The power of two u with largest / u in [1, 2); 1 for zero or non-finite weights (no
    scale to take out)."""
    if not math.isfinite(largest) or largest <= 0:
        return 1.0
    # clamped so that 1 / unit stays a finite float64 (only float64 subnormals are past it)
    return math.ldexp(1.0, min(max(math.frexp(largest)[1] - 1, -1000), 1000))


def row_factors(W: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """(heads·d, n) rows → (heads, n, d): each head's block, transposed to an n × d factor."""
    return W.reshape(heads, d, W.shape[1]).transpose(1, 2)


def column_factors(W_o: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """W_O (E, heads·d) → (heads, E, d): each head's columns."""
    return W_o.reshape(W_o.shape[0], heads, d).permute(1, 0, 2)


def factor_roots(factors: torch.Tensor) -> torch.Tensor:
    """(n, E, d) factors F → (n, d, d) float64 T with TᵀT = FᵀF.

    Every number of a circuit depends on its factors only through FᵀF (‖F X‖_F = ‖T X‖_F, and
    F = Q T with Q orthonormal on F's column space), so T plays the role of the R factor of
    F's QR factorization, from one product of F with itself instead of a Householder QR
    (20× slower for E × d on a CPU). T = Λ^½ Pᵀ from FᵀF = P Λ Pᵀ, so rank-deficient F is fine.
    Large factors take a float32 Gram: well-conditioned ones its Cholesky factor
    (`_cholesky_roots`), the others refined where it is not exact enough (`_refined`).
    """
    if not len(factors) or factors[0].numel() <= EXACT_FACTOR_NUMEL:
        gram = _grams(factors, torch.float64)
        with small_algebra():
            values, vectors = torch.linalg.eigh(gram)  # ascending
        return _eigen_roots(values, vectors)
    gram = _grams(factors, torch.float32)
    roots, done = _cholesky_roots(gram)
    if not bool(done.all()):
        rest = torch.nonzero(~done).flatten()
        roots[rest] = _eigen_roots(*_refined(factors[rest], gram[rest]))
    return roots


def _eigen_roots(values: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    return values.clamp_min(0).sqrt()[:, :, None] * vectors.transpose(1, 2)


def _grams(factors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, d, d) float64 FᵀF, accumulated in `dtype`, symmetrized. In float32 only the upper
    three quarters are multiplied (the top rows, then the bottom right block), the bottom
    left mirrored: 15 % less time than the whole product."""
    F = factors.to(dtype)  # (n, E, d)
    d = F.shape[2]
    if dtype == torch.float64 or d < 32:
        gram = (F.transpose(1, 2) @ F).double().cpu()
        return (gram + gram.transpose(1, 2)) / 2
    top = (F[:, :, :d // 2].transpose(1, 2) @ F).double().cpu()  # (n, d/2, d)
    bottom = (F[:, :, d // 2:].transpose(1, 2) @ F[:, :, d // 2:]).double().cpu()
    gram = torch.empty(F.shape[0], d, d, dtype=torch.float64)
    gram[:, :d // 2] = top
    gram[:, d // 2:, :d // 2] = top[:, :, d // 2:].transpose(1, 2)
    gram[:, d // 2:, d // 2:] = (bottom + bottom.transpose(1, 2)) / 2
    top_left = gram[:, :d // 2, :d // 2]
    top_left.copy_((top_left + top_left.transpose(1, 2)) / 2)
    return gram


def _cholesky_roots(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T = Lᵀ from G = L Lᵀ, which heads it serves) for the heads whose Gram has no eigenvalue
    below REFINE_SHARE × its largest, proven by the Cholesky factorization of G − c I with
    c = REFINE_SHARE ‖G‖_F (≥ REFINE_SHARE λ_max) succeeding, i.e. λ_min > c. Those are the
    heads `_refined` leaves as the float32 Gram gives them, and any T with TᵀT = G gives the
    same circuits: two Cholesky factorizations cost a quarter of one eigendecomposition."""
    shift = REFINE_SHARE * torch.linalg.matrix_norm(gram)  # (n,)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    with small_algebra():
        _, info = torch.linalg.cholesky_ex(gram - shift[:, None, None] * eye)
        done = (info == 0) & (shift > 0)
        roots = torch.zeros_like(gram)
        if bool(done.any()):
            lower, info = torch.linalg.cholesky_ex(gram[done])
            roots[done] = lower.transpose(1, 2)
            done[done.clone()] = info == 0
    return roots, done


def _refined(factors: torch.Tensor, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues ascending, eigenvectors) of FᵀF, float64, from its float32 Gram.

    A float32 Gram sums E products per entry: its error, ~1e-6 of the largest eigenvalue, would
    give a rank-deficient F singular values of ~1e-3 of its largest, above RANK_RTOL. So the
    float32 Gram only finds the eigenvectors P; then Y = F P (float32, each entry a sum of d
    products, accurate to ~1e-7 of F's row) has the columns of the small eigenvalues, and
    their products with every column, summed in float64: E · d · k float64 work for the k
    small ones (none for a well-conditioned head), instead of E · d² for all of them.
    """
    with small_algebra():
        values, vectors = torch.linalg.eigh(gram)
    small = values < REFINE_SHARE * values[:, -1:]  # (n, d)
    for i in torch.nonzero(small.any(dim=1)).flatten().tolist():
        P = vectors[i]
        Y = factors[i].float() @ P.to(device=factors.device, dtype=torch.float32)  # (E, d)
        G = (Y.T @ Y).double().cpu()
        Y64 = Y.double()
        cross = (Y64.T @ Y64[:, small[i].to(Y.device)]).cpu()  # (d, k), float64 sums
        G[:, small[i]] = cross
        G[small[i], :] = cross.T
        with small_algebra():
            values[i], rotation = torch.linalg.eigh((G + G.T) / 2)
        vectors[i] = P @ rotation
    return values, vectors


def chunks(heads: int, step: int) -> Iterator[slice]:
    for start in range(0, heads, step):
        yield slice(start, min(start + step, heads))


def row_roots(W: StoredWeight, heads: int, d: int, device: torch.device | str) -> torch.Tensor:
    """(heads, d, d) roots of each head's rows of W (W_Q, W_K or W_V), a chunk at a time."""
    found = []
    for part in chunks(heads, HEAD_CHUNK):
        rows = W.as_float(slice(part.start * d, part.stop * d), device=device)
        found.append(factor_roots(row_factors(rows, part.stop - part.start, d)))
    return torch.cat(found)


def output_roots(W_o: StoredWeight, W_v: torch.Tensor | None, heads: int, kv_heads: int,
                 d: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(heads, d, d) roots of each head's columns of W_O and, given the folded W_V (float32),
    the (heads, d, d) float64 blocks W_V^{g(h)} W_O[:, cols(h)] whose eigenvalues are W_OV^h's
    nonzero ones. A chunk holds whole key/value groups, so each W_V^g meets its heads' columns
    in one product while they are converted."""
    group = heads // kv_heads
    step = group * max(1, HEAD_CHUNK // group)
    dtype = gram_dtype(W_o.tensor)  # float32 for large weights: a ratio of sums, no rank
    roots, blocks = [], []
    for part in chunks(heads, step):
        cols = W_o.as_float(cols=slice(part.start * d, part.stop * d), device=device)
        roots.append(factor_roots(column_factors(cols, part.stop - part.start, d)))
        if W_v is None:
            continue
        groups = slice(part.start // group, part.stop // group)
        V = W_v[groups.start * d:groups.stop * d].reshape(-1, d, W_v.shape[1]).to(dtype)
        by_group = cols.to(dtype).reshape(cols.shape[0], V.shape[0], group * d).permute(1, 0, 2)
        cross = (V @ by_group).cpu()  # (groups, d, group·d), in the Gram dtype
        blocks.append(cross.reshape(V.shape[0], d, group, d).permute(0, 2, 1, 3)
                      .reshape(-1, d, d))
    return torch.cat(roots), (torch.cat(blocks) if W_v is not None else None)
