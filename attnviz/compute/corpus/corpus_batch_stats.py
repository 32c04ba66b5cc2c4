"""Each example's sums of every statistic of `compute.measures.stats.stat_sums`, for a whole padded
batch
at once: the per-sentence pattern pairs become (B, L, L) key masks, and every sum one masked
reduction over (B, H, L, L), so the cost is a few passes over the maps instead of a Python loop
per example, layer and pattern. What stat_sums sums over pairs (q, k), this sums over the
masked entries: a query with no pair adds 0 either way, and the counts (queries that exercised
each pattern) come from the tokens alone. Rows and columns past an example's length are zeroed
first, so padding never adds. Sums are float32 per row, added up in float64, as in stat_sums."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attnviz.compute.corpus.corpus_sums import STATISTICS
from attnviz.compute.measures.stats import SPECIAL_RE, is_punctuation

INDEX = {name: i for i, name in enumerate(STATISTICS)}


@functools.lru_cache(maxsize=4)
def _distances(n: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)
    return (pos[:, None] - pos[None, :]).abs()


def _key_marks(tokens: list[list[str]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(special, punctuation) key columns (B, L) float32, from each example's tokens."""
    special = torch.zeros(len(tokens), length)
    marks = torch.zeros(len(tokens), length)
    for b, toks in enumerate(tokens):
        special[b, :len(toks)] = torch.tensor([float(bool(SPECIAL_RE.match(t))) for t in toks])
        marks[b, :len(toks)] = torch.tensor([float(is_punctuation(t)) for t in toks])
    return special, marks


def _copy_masks(tokens: list[list[str]], length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(duplicate, induction) (B, L, L) bool: [q, k] where k < q is an earlier copy of q's
    token, and where k = j + 1 < q follows such a copy j."""
    ids = torch.full((len(tokens), length), -1, dtype=torch.long)
    for b, toks in enumerate(tokens):
        table = {t: i for i, t in enumerate(dict.fromkeys(toks))}
        ids[b, :len(toks)] = torch.tensor([table[t] for t in toks])
    earlier = torch.ones(length, length, dtype=torch.bool).tril(-1)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0) & earlier
    after = torch.zeros_like(same)
    after[:, :, 1:] = same[:, :, :-1] & earlier[:, 1:]  # key j + 1 < q
    return same, after


@dataclass(frozen=True)
class BatchPatterns:
    """A batch's token structure, shared by every layer's maps: lengths, the (example, query,
    key) pairs of duplicate and induction (few: gathered, never a dense pass), the special and
    punctuation key columns, and the counts."""

    lengths: torch.Tensor  # (B,)
    duplicate: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (b, q, k) of each pair
    induction: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    columns: torch.Tensor  # (B, L, 2) float32: special, punctuation keys
    counts: torch.Tensor  # (B, S) float64


def batch_patterns(tokens: list[list[str]], length: int) -> BatchPatterns:
    lengths = torch.tensor([len(t) for t in tokens])
    duplicate, induction = _copy_masks(tokens, length)
    special, marks = _key_marks(tokens, length)
    counts = _counts(lengths, duplicate, induction, special, marks)
    return BatchPatterns(lengths, duplicate.nonzero(as_tuple=True),  # type: ignore[arg-type]
                         induction.nonzero(as_tuple=True),  # type: ignore[arg-type]
                         torch.stack([special, marks], -1), counts)


def batch_sums(weights: torch.Tensor, patterns: BatchPatterns) -> torch.Tensor:
    """(B, H, S) float64 sums of self-attention maps (B, H, L, L) whose examples have the
    given token structure (S: STATISTICS); the counts are `patterns.counts`."""
    B, H, L, _ = weights.shape
    lengths = patterns.lengths
    real = torch.arange(L)[None, :] < lengths[:, None]  # (B, L)
    block = (real[:, :, None] & real[:, None, :])[:, None]  # (B, 1, L, L)
    a = torch.where(block, weights.float(), 0.0)  # (B, H, L, L) real queries and keys only
    rows = torch.zeros(len(STATISTICS), B, H, L)  # each query's term, float32

    def put(name: str, terms: torch.Tensor) -> None:  # terms (B, H, r)
        rows[INDEX[name], :, :, :terms.shape[-1]] = terms

    # -Σ a ln a: torch's fused entr is xlogx_rows' value (0 · ln 0 = 0) in two passes instead
    # of five; they differ only on subnormal weights (< 2⁻¹²⁶), by less than 2⁻¹²²
    put("entropy", torch.special.entr(a).sum(-1))
    put("max_weight", a.amax(-1))
    # a product and a row sum: about 3x faster on a CPU than einsum, which permutes the maps
    # to batch over queries
    put("distance", (a * _distances(L)).sum(-1))
    put("self", a.diagonal(0, 2, 3))
    put("previous", a.diagonal(-1, 2, 3))
    put("next", a.diagonal(1, 2, 3))
    put("first", a[:, :, 1:, 0])
    last_key = (lengths - 1).clamp(min=0)  # (B,)
    on_last = a.gather(3, last_key.view(B, 1, 1, 1).expand(B, H, L, 1))[..., 0]  # (B, H, L)
    put("last", torch.where(torch.arange(L)[None, None, :] == last_key.view(B, 1, 1), 0.0,
                            on_last))  # the last query itself is not counted
    keys = torch.bmm(a.reshape(B, H * L, L), patterns.columns).view(B, H, L, 2)
    put("special", keys[..., 0])
    put("punctuation", keys[..., 1])
    for name in ("duplicate", "induction"):
        b, q, k = getattr(patterns, name)
        if len(b):
            rows[INDEX[name]].index_put_((b[:, None], torch.arange(H)[None, :], q[:, None]),
                                         a[b, :, q, k], accumulate=True)
    return rows.double().sum(-1).permute(1, 2, 0)


def _counts(lengths: torch.Tensor, duplicate: torch.Tensor, induction: torch.Tensor,
            special: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:  # masks bool
    """(B, S) float64: the queries each statistic averages over, per example."""
    n = lengths.double()
    before = (n - 1).clamp(min=0)
    counts = torch.zeros(len(lengths), len(STATISTICS), dtype=torch.float64)
    for name in ("entropy", "max_weight", "distance", "self"):
        counts[:, INDEX[name]] = n
    for name in ("first", "previous", "last", "next"):
        counts[:, INDEX[name]] = before
    counts[:, INDEX["duplicate"]] = duplicate.any(-1).sum(-1).double()
    counts[:, INDEX["induction"]] = induction.any(-1).sum(-1).double()
    counts[:, INDEX["special"]] = torch.where(special.sum(-1) > 0, n, 0.0)
    counts[:, INDEX["punctuation"]] = torch.where(marks.sum(-1) > 0, n, 0.0)
    return counts
