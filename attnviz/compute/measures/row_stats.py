"""Statistics of maps computed in blocks of query rows.

`row_terms` gives, for each query row of a block, its term of every sum `stat_sums` takes
(its entropy, max weight, attended distance, weight on each pattern's keys), so that a map
computed block by block never exists whole. Each term reads the block a fixed number of times
and never builds an n × n array: distances through one skinny matmul, patterns by gathering
their (query, key) pairs, generated block by block from the sentence's sorted tokens. The sums
and the means they add up to live in `attnviz.compute.measures.stats`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from attnviz.compute.measures.stats import PATTERNS, SPECIAL_RE, is_punctuation, xlogx_rows

if TYPE_CHECKING:
    from numpy.typing import NDArray

# not statistics: total, Σ_j a_ij over all keys, bias_k included (a finiteness check); later,
# Σ_{j > i} a_ij, the weight on real keys after the query (0 on every row of a causal map)
ROW_TERMS = ("entropy", "max_weight", "distance", *PATTERNS, "special", "total", "later")
NOT_STATISTICS = ("total", "later")
FREQUENT_TOKENS = 8  # the most common tokens (of at least FREQUENT_MIN copies) get matmul columns
FREQUENT_MIN = 16
DENSE_PAIRS = 16  # a block gathers pairs of other tokens while they are < 1/16 of its entries


@functools.lru_cache(maxsize=8)
def _near(rows: int, cols: int, device: str) -> torch.Tensor:
    """|i - j| for the (rows, cols) keys beside a block of query rows (block-local indices)."""
    return (torch.arange(rows, device=device, dtype=torch.float32)[:, None]
            - torch.arange(cols, device=device, dtype=torch.float32)).abs()


@dataclass(frozen=True)
class SentencePatterns:
    """One sentence's duplicate/induction structure, for any block of query rows.

    A query's earlier copies split at its block's first row r0: keys inside the block are
    compared densely (r × r); keys left of it are summed by the block's one matmul for the
    sentence's most common tokens (a column per token, and one for the token before each key),
    and gathered pair by pair for all other tokens, whose pairs are few: positions sorted by
    (token, position) put the earlier copies of position i at
    order[group_start[i] : group_start[i] + copies[i]].
    """

    token_ids: torch.Tensor  # (n,) int64
    prev_ids: torch.Tensor  # (n,) the token before each position (-1 at 0)
    frequent: torch.Tensor  # (n,) index of the position's token among the common ones, or -1
    columns: torch.Tensor  # (n, 2T) float32: token_j = t, token_{j-1} = t, per common t
    copies_cum: list[int]  # prefix sums of earlier copies of uncommon tokens (host ints)
    special: torch.Tensor  # (n,) float32: 1 at special tokens ([CLS], </s>, …)
    counts: dict[str, int]  # queries each pattern averages over
    host: dict[str, NDArray[Any]]  # order, group_start, copies (uncommon tokens), ids, prev,
    #                               special
    punctuation: torch.Tensor  # (n,) float32: 1 at punctuation tokens

    def to(self, device: torch.device) -> SentencePatterns:
        return replace(self, token_ids=self.token_ids.to(device),
                       prev_ids=self.prev_ids.to(device), frequent=self.frequent.to(device),
                       columns=self.columns.to(device), special=self.special.to(device),
                       punctuation=self.punctuation.to(device))


def sentence_patterns(tokens: tuple[str, ...]) -> SentencePatterns:
    n = len(tokens)
    ids = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    token_ids = torch.tensor([ids[t] for t in tokens], dtype=torch.long)
    prev_ids = torch.full((n,), -1, dtype=torch.long)
    prev_ids[1:] = token_ids[:-1]
    order = torch.sort(token_ids, stable=True).indices
    sorted_ids = token_ids[order]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    # for each slot of `order`, where its group starts: the running max of group starts
    first_slot = torch.cummax(torch.where(starts, torch.arange(n), 0), 0).values
    group_start = torch.empty(n, dtype=torch.long)
    group_start[order] = first_slot
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n)
    copies = rank - group_start
    # induction pairs: earlier copies j with j + 1 < i, i.e. all but a copy at i - 1
    repeat_prev = (prev_ids == token_ids).long()
    special = torch.tensor([float(bool(SPECIAL_RE.match(t))) for t in tokens])
    marks = torch.tensor([float(is_punctuation(t)) for t in tokens])
    counts = {"entropy": n, "max_weight": n, "distance": n, "first": n - 1, "previous": n - 1,
              "last": n - 1, "self": n, "duplicate": int((copies > 0).sum()),
              "induction": int((copies - repeat_prev > 0).sum()),
              "special": n if bool(special.any()) else 0, "next": n - 1,
              "punctuation": n if bool(marks.any()) else 0, "total": n}
    occurrences = torch.bincount(token_ids)
    common = [t for t in torch.argsort(occurrences, descending=True, stable=True)[
        :FREQUENT_TOKENS].tolist() if occurrences[t] >= FREQUENT_MIN]
    frequent = torch.full((len(ids),), -1, dtype=torch.long)
    frequent[common] = torch.arange(len(common))
    columns = torch.zeros(n, 2 * len(common))
    for f, t in enumerate(common):
        columns[:, f] = (token_ids == t).float()
        columns[:, len(common) + f] = (prev_ids == t).float()
    rare_copies = torch.where(frequent[token_ids] < 0, copies, 0)
    cum = [0, *torch.cumsum(rare_copies, 0).tolist()]
    host = {"order": order.numpy(), "group_start": group_start.numpy(),
            "copies": rare_copies.numpy(), "ids": token_ids.numpy(), "prev": prev_ids.numpy(),
            "special": special.numpy(), "punctuation": marks.numpy()}
    return SentencePatterns(token_ids, prev_ids, frequent[token_ids], columns, cum, special,
                            counts, host, marks)


def row_terms(attn: torch.Tensor, row_start: int, keys: int, patterns: SentencePatterns,
              scores: torch.Tensor | None = None,
              score_max: torch.Tensor | None = None) -> torch.Tensor:
    """Each query row's term of every statistic, (len(ROW_TERMS), heads, r) float32.

    attn (heads, r, keys + extra): weights of the sentence's queries row_start .. row_start + r
    against its first `keys` real keys (every later real key has weight 0, as under a causal
    mask), then `extra` columns outside the real keys (bias_k), which count only in `total`.
    scores, optional: the pre-softmax scores (finite everywhere; where a mask zeroed a weight,
    any finite value), so that entropy needs no logarithm per entry. score_max (heads, r),
    optional with scores: each row's largest score over all the keys it sees (extra ones
    included), which spares a search for the position of the largest weight.
    """
    H, r, width = attn.shape
    device = attn.device
    real = attn[..., :keys]
    rows = torch.arange(r, device=device)
    out = zeros((len(ROW_TERMS), H, r), device)
    term = dict(zip(ROW_TERMS, out, strict=True))
    if scores is None:
        top = real.amax(-1)
        term["entropy"].sub_(xlogx_rows(real))
    else:
        top, log_norm, dot = _log_normalizer(real, scores[..., :keys],
                                             None if score_max is None else
                                             (score_max, attn[..., keys:]))
    term["max_weight"].copy_(top)

    # One matmul reads the block once for: row sums; distances, Σ_j a_ij |i - j| split at the
    # block's own keys into keys left of it (|i - j| = i - j), right of it (j - i) and the r × r
    # keys beside it, measured from row_start so that float32 sums stay exact on long rows; and
    # the weight left of the block on each common token (and on the key after each copy).
    # And the weight on special tokens.
    sums = _skinny_matmul(attn, _block_columns(patterns, width, row_start, r, keys, device))
    local = rows.to(torch.float32)
    stop = min(row_start + r, keys)
    beside = real[..., row_start:stop]  # (H, r, c)
    # the keys beside the block, one product: |i - j|, 1, earlier copy, key after a copy, key
    # after the query
    near = torch.einsum("hrc,krc->khr", beside, _beside_masks(patterns, row_start, r, stop,
                                                              device))
    term["total"].copy_(sums[..., 0])
    term["later"].copy_(sums[..., 3] + near[4])
    term["distance"].copy_(local * sums[..., 1] - sums[..., 2] + sums[..., 4] - local * sums[..., 3]
                           + near[0])
    if scores is not None:
        mass = sums[..., 1] + sums[..., 3] + near[1]  # Σ over real keys
        term["entropy"].copy_(torch.where(top > 0, log_norm * mass, 0.0) - dot)
    term["special"].copy_(sums[..., 5])
    term["punctuation"].copy_(sums[..., 6])
    _position_terms(term, real, row_start, keys, len(patterns.token_ids))
    _copy_terms(term, attn, (sums, near), row_start, keys, patterns)
    return out


def _skinny_matmul(attn: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """attn (H, r, width) @ columns (width, c) for a few columns: (H, r, c). On a CPU as
    F.linear with the columns stored one after another, which reads a block this shape about
    twice as fast as torch's mm. Never through numpy's BLAS: its own thread pool spins after
    each call on the cores torch's threads need, which measured twice as slow for the eager
    attention around it on a 2-core machine."""
    if attn.device.type != "cpu":
        return attn @ columns
    H, r, width = attn.shape
    flat = attn.reshape(H * r, width)
    return torch.nn.functional.linear(flat, columns.T.contiguous()).view(H, r, -1)


def _log_normalizer(real: torch.Tensor, s: torch.Tensor,
                    known: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max weight, lse, Σ_j a_ij s_ij) per row (H, r): ln a_ij = s_ij - lse_i, and at the row's
    largest weight lse = s_max - ln a_max (one pass finds both the max weight and where it is).
    known: (each row's largest score over all its keys, the weights of its extra keys): softmax
    is monotone, so the largest weight sits at the largest score, and a_max is one amax."""
    if known is None:
        top, top_index = real.max(-1)
        log_norm = s.gather(-1, top_index[..., None])[..., 0] - top.log()
    else:
        score_max, extra = known
        top = real.amax(-1)
        largest = top if extra.shape[-1] == 0 else torch.maximum(top, extra.amax(-1))
        log_norm = score_max - largest.log()
    return top, log_norm, _row_dot(real, s)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_j a_ij b_ij per row (H, r); on a CPU through numpy (no parallel region per block)."""
    if a.device.type != "cpu":
        return torch.einsum("hij,hij->hi", a, b)
    import numpy as np

    return torch.from_numpy(np.einsum("hij,hij->hi", a.numpy(), b.numpy()))


def zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """torch.zeros, on a CPU from numpy's calloc: no parallel fill region per block."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device)
    import numpy as np

    return torch.from_numpy(np.zeros(shape, dtype=np.float32))


def _position_terms(term: dict[str, torch.Tensor], real: torch.Tensor, row_start: int,
                    keys: int, n: int) -> None:
    """The terms that read fixed positions: self, previous, next (diagonals of the block, as
    strided views: no gather), first, last. Queries row_start + i of a block always see their
    own key and the one before it (row_start + r ≤ keys)."""
    r = real.shape[1]
    term["self"].copy_(real.diagonal(row_start, 1, 2))
    if row_start > 0:
        term["previous"].copy_(real.diagonal(row_start - 1, 1, 2))
    else:  # query 0 has no previous token
        term["previous"][:, 1:].copy_(real.diagonal(-1, 1, 2))
    following = real.diagonal(row_start + 1, 1, 2)  # keys up to keys - 1: 0 beyond (causal)
    term["next"][:, :following.shape[-1]].copy_(following)
    term["first"].copy_(real[:, :, 0])
    if row_start == 0:
        term["first"][:, 0] = 0.0
    if n - 1 < keys:  # under a causal mask no query before the last sees the last token
        term["last"].copy_(real[:, :, n - 1])
        if n - 1 - row_start < r:  # the last query itself is not counted
            term["last"][:, n - 1 - row_start] = 0.0


def _copy_terms(term: dict[str, torch.Tensor], attn: torch.Tensor,
                products: tuple[torch.Tensor, torch.Tensor], row_start: int, keys: int,
                patterns: SentencePatterns) -> None:
    """duplicate / induction: keys beside the block (dense, in `near`), common tokens left of it
    (the block matmul's token columns, in `sums`), other tokens left of it (gathered);
    products: (sums, near)."""
    sums, near = products
    H, r, _ = attn.shape
    common = patterns.columns.shape[1] // 2
    term["duplicate"].copy_(near[2])
    term["induction"].copy_(near[3])
    if common and row_start > 0:
        which = patterns.frequent[row_start:row_start + r]
        pick = (which.clamp(min=0) + 7).expand(H, r)[..., None]
        found = (which >= 0).to(torch.float32)
        term["duplicate"].add_(sums.gather(-1, pick)[..., 0] * found)
        term["induction"].add_(sums.gather(-1, pick + common)[..., 0] * found)
    _rare_copies(attn, row_start, keys, patterns, term["duplicate"], term["induction"])


def _block_columns(patterns: SentencePatterns, width: int, row_start: int, r: int, keys: int,
                   device: torch.device) -> torch.Tensor:
    """(width, 7 + 2T): every key, keys left of the block, their offset from row_start, keys
    right of it (real ones), their offset, special tokens and punctuation (real keys), then the
    common-token columns of the keys left of it. The first seven built on the host (numpy: no
    parallel region per block)."""
    import numpy as np

    common = patterns.columns.shape[1]
    on_host = device.type == "cpu"
    columns = np.zeros((width, 7 + (common if on_host else 0)), dtype=np.float32)
    columns[:, 0] = 1.0
    columns[:row_start, 1] = 1.0
    columns[:row_start, 2] = np.arange(-row_start, 0, dtype=np.float32)
    columns[row_start + r:keys, 3] = 1.0
    columns[row_start + r:keys, 4] = np.arange(r, keys - row_start, dtype=np.float32)
    columns[:keys, 5] = patterns.host["special"][:keys]
    columns[:keys, 6] = patterns.host["punctuation"][:keys]
    if on_host:
        columns[:row_start, 7:] = patterns.columns.numpy()[:row_start]
        return torch.from_numpy(columns)
    tokens = torch.zeros(width, common, device=device)
    tokens[:row_start] = patterns.columns[:row_start]
    return torch.cat([torch.from_numpy(columns).to(device), tokens], 1)


def _beside_masks(patterns: SentencePatterns, row_start: int, r: int, stop: int,
                  device: torch.device) -> torch.Tensor:
    """(5, r, c) float32 over the keys beside a block (c = stop - row_start): |i - j|, 1, key
    an earlier copy of the query's token, key right after such a copy (and before the query),
    key after the query. On a CPU built with numpy (single-threaded: no parallel region per
    block)."""
    c = stop - row_start
    if device.type != "cpu":
        ids = patterns.token_ids[row_start:row_start + r, None]
        before = torch.ones(r, c, dtype=torch.bool, device=device).tril(-1)
        return torch.stack([_near(r, c, str(device)), torch.ones(r, c, device=device),
                            ((ids == patterns.token_ids[row_start:stop]) & before).float(),
                            ((ids == patterns.prev_ids[row_start:stop]) & before).float(),
                            torch.ones(r, c, device=device).triu(1)])
    import numpy as np

    host_ids = patterns.host["ids"]
    prev = patterns.host["prev"]
    i = np.arange(r)[:, None]
    j = np.arange(c)[None, :]
    masks = np.empty((5, r, c), dtype=np.float32)
    np.abs(i - j, out=masks[0], casting="unsafe")
    masks[1] = 1.0
    earlier = j < i
    rows = host_ids[row_start:row_start + r, None]
    np.logical_and(rows == host_ids[None, row_start:stop], earlier, out=masks[2], casting="unsafe")
    np.logical_and(rows == prev[None, row_start:stop], earlier, out=masks[3], casting="unsafe")
    np.greater(j, i, out=masks[4], casting="unsafe")
    return torch.from_numpy(masks)


def _rare_copies(attn: torch.Tensor, row_start: int, keys: int, patterns: SentencePatterns,
                 duplicate: torch.Tensor, induction: torch.Tensor) -> None:
    """Weight on earlier copies left of the block for tokens without a matmul column:
    gathered pair by pair while the pairs are few, else through a dense mask."""
    H, r, width = attn.shape
    device = attn.device
    stop = row_start + r
    pairs = patterns.copies_cum[stop] - patterns.copies_cum[row_start]
    if pairs == 0 or row_start == 0:
        return
    if pairs * DENSE_PAIRS > r * row_start:
        ids = patterns.token_ids[row_start:stop, None]
        rare = (patterns.frequent[row_start:stop] < 0)[:, None]
        left = attn[..., :row_start]
        same = (ids == patterns.token_ids[:row_start]) & rare
        after = (ids == patterns.prev_ids[:row_start]) & rare
        duplicate.add_(torch.where(same, left, 0.0).sum(-1))
        induction.add_(torch.where(after, left, 0.0).sum(-1))
        return
    local, key = _block_pairs(patterns, row_start, stop, pairs)
    flat = attn.reshape(H, r * width)
    for target, shift in ((duplicate, 0), (induction, 1)):
        keep = key + shift < row_start  # left of the block; the rest were counted beside it
        rows_kept = local[keep]
        index = (rows_kept * width + key[keep] + shift).to(device)
        target.index_add_(1, rows_kept.to(device), flat.index_select(1, index))


def _block_pairs(patterns: SentencePatterns, start: int, stop: int,
                 pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-local query, key) of every earlier-copy pair of queries start..stop whose token
    has no matmul column, on the host (numpy: index arithmetic, no parallel region)."""
    import numpy as np

    copies = patterns.host["copies"][start:stop]
    local = np.repeat(np.arange(stop - start), copies)
    first = np.cumsum(copies) - copies
    nth = np.arange(pairs) - np.repeat(first, copies)
    key = patterns.host["order"][patterns.host["group_start"][start + local] + nth]
    return torch.from_numpy(local), torch.from_numpy(key)
