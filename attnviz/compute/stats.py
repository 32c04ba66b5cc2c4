"""Per-head statistics of attention maps, and labels for heads that clearly do one thing.

All statistics average over the real (non-padding) query positions of every sentence:
- entropy: -Σ_j a_ij ln a_ij (nats);  max weight: max_j a_ij;
- distance: Σ_j a_ij |i - j| (mean attended distance, in tokens);
- first: a_i0 (queries i ≥ 1);  previous: a_i,i-1 (i ≥ 1);  self: a_ii;
- duplicate: Σ a_ij over earlier j with token_j = token_i (queries that repeat a token);
- induction: Σ a_i,j+1 over earlier j with token_j = token_i and j + 1 < i (the token that
  followed the earlier occurrence; Olsson et al., 2022), over queries that repeat a token;
- last: a_i,n-1 (queries i < n - 1): the final token, [SEP] or </s> in encoders (Clark et al.,
  2019, "What Does BERT Look At?");
- special: Σ a_ij over special tokens j ([CLS], [SEP], <s>, </s>, <|endoftext|>, …: SPECIAL_RE),
  over sentences that have one.

Cross-attention maps (queries from one sequence, keys from another: an encoder-decoder's target
over its source) have entropy, max weight and first (a_i0, every query) only: distances and
the token patterns compare positions of one sequence.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

LABEL_THRESHOLD = 0.5  # a head is labelled when one pattern takes at least half its attention
PATTERNS = ("previous", "first", "last", "self", "duplicate", "induction")
LABEL_NAMES = {"previous": "previous-token", "first": "first-token", "last": "last-token",
               "self": "self", "duplicate": "duplicate-token", "induction": "induction"}
# Tokenizers' special tokens as they print: [CLS] [SEP] [PAD], <s> </s> <pad> <unk>, <|endoftext|>
SPECIAL_RE = re.compile(r"^(\[[A-Z_]+\]|</?[a-z_]+>|<\|[^|<>\s]+\|>)$")


@dataclass(frozen=True)
class HeadStats:
    layer: int
    head: int
    entropy: float
    max_weight: float
    distance: float | None  # None for cross-attention
    first: float
    previous: float | None  # None for cross-attention
    self: float | None
    duplicate: float | None  # None when no sentence repeats a token (or cross-attention)
    induction: float | None
    last: float | None = None  # None when every sentence is one token long
    special: float | None = None  # None when no sentence has a special token
    layer_label: str | None = None  # how the run labels the layer ("enc 0"), if not by number

    @property
    def label(self) -> str:
        """The pattern holding ≥ LABEL_THRESHOLD of the attention, or "" (the strongest wins)."""
        scores = {name: getattr(self, name) for name in PATTERNS}
        best = max((s, n) for n, s in scores.items() if s is not None)
        return LABEL_NAMES[best[1]] if best[0] >= LABEL_THRESHOLD else ""

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "label": self.label}


@functools.lru_cache(maxsize=8)  # streaming asks once per head for the same sentences
def pattern_pairs(tokens: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(query, key) index pairs each pattern points at, for one unpadded sentence."""
    n = len(tokens)
    ids = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    token_ids = torch.tensor([ids[t] for t in tokens])
    positions = torch.arange(n)
    # earlier copies of the query's token; tokens rarely repeat, so the pairs stay few
    same = (token_ids[:, None] == token_ids[None, :]).tril(-1)
    dup_q, dup_k = same.nonzero(as_tuple=True)
    keep = dup_k + 1 < dup_q  # induction target: the token after the copy, before the query
    specials = torch.tensor([bool(SPECIAL_RE.match(t)) for t in tokens])
    special_q, special_k = specials[None, :].expand(n, n).nonzero(as_tuple=True)
    return {
        "previous": (positions[1:], positions[:-1]),
        "first": (positions[1:], torch.zeros(n - 1, dtype=torch.long)),
        "last": (positions[:-1], torch.full((n - 1,), n - 1, dtype=torch.long)),
        "special": (special_q, special_k),
        "self": (positions, positions),
        "duplicate": (dup_q, dup_k),
        "induction": (dup_q[keep], dup_k[keep] + 1),
    }


@functools.lru_cache(maxsize=2)
def _distances(n: int) -> torch.Tensor:
    """|i - j| for an n × n map."""
    pos = torch.arange(n, dtype=torch.float32)
    return (pos[:, None] - pos[None, :]).abs()


@functools.lru_cache(maxsize=8)
def _near(rows: int, cols: int, device: str) -> torch.Tensor:
    """|i - j| for the (rows, cols) keys beside a block of query rows (block-local indices)."""
    return (torch.arange(rows, device=device, dtype=torch.float32)[:, None]
            - torch.arange(cols, device=device, dtype=torch.float32)).abs()


StatSums = tuple[dict[str, torch.Tensor], dict[str, int]]  # per-head sums (H,), and counts


def head_stats(weights: torch.Tensor, tokens: list[list[str]], layer: int,
               scores: torch.Tensor | None = None,
               key_tokens: list[list[str]] | None = None) -> list[HeadStats]:
    """Statistics of maps (B, H, L, S) for sentences with the given (unpadded) tokens; with
    key_tokens, of cross-attention maps whose columns are those tokens."""
    if key_tokens is not None:
        return finish_stats(cross_sums(weights, tokens, key_tokens), layer)
    return finish_stats(stat_sums(weights, tokens, scores), layer)


def cross_sums(weights: torch.Tensor, tokens: list[list[str]],
               key_tokens: list[list[str]]) -> StatSums:
    """stat_sums of cross-attention maps: rows are `tokens`, columns `key_tokens`."""
    H = weights.shape[1]
    names = ("entropy", "max_weight", "distance", *PATTERNS)
    sums = {name: torch.zeros(H, dtype=torch.float64) for name in names}
    counts = dict.fromkeys(sums, 0)
    for b, (rows, cols) in enumerate(zip(tokens, key_tokens, strict=True)):
        a = weights[b, :, :len(rows), :len(cols)].float()  # (H, T, S) real rows and columns
        sums["entropy"] -= torch.special.xlogy(a, a).sum((-1, -2)).double()
        sums["max_weight"] += a.max(-1).values.sum(-1).double()
        sums["first"] += a[:, :, 0].sum(-1).double()
        for name in ("entropy", "max_weight", "first"):
            counts[name] += len(rows)
    return sums, counts


def stat_sums(weights: torch.Tensor, tokens: list[list[str]],
              scores: torch.Tensor | None = None) -> StatSums:
    """The sums and counts behind head_stats' means, so that maps computed in pieces (one
    sentence at a time) add up to the same statistics.

    With the pre-softmax `scores` the maps came from, entropy is computed without a logarithm
    per entry: since a = softmax(s), ln a = s - lse with lse = s_jmax - ln a_jmax, so
    -Σ a ln a = lse · Σ a - Σ a s (Σ a < 1 when a bias_k key, outside the real keys, takes some).
    """
    H = weights.shape[1]
    sums = {name: torch.zeros(H, dtype=torch.float64) for name in
            ("entropy", "max_weight", "distance", *PATTERNS, "special")}
    counts = dict.fromkeys(sums, 0)
    for b, toks in enumerate(tokens):
        n = len(toks)
        a = weights[b, :, :n, :n].float()  # (H, n, n) real queries and keys only
        top, top_index = a.max(-1)  # (H, n)
        if scores is None:
            sums["entropy"] -= torch.special.xlogy(a, a).sum((-1, -2)).double()  # 0 · log 0 = 0
        else:
            s = scores[b, :, :n, :n].float()
            lse = s.gather(-1, top_index[..., None])[..., 0] - top.log()  # (H, n)
            # einsum reduces without an (H, n, n) temporary: several times faster than a * s
            # a row whose real keys all underflowed to 0 adds 0 (not inf · 0)
            mass = torch.where(top > 0, lse * a.sum(-1), 0.0)
            sums["entropy"] += (mass - torch.einsum("hij,hij->hi", a, s)).sum(-1).double()
        sums["max_weight"] += top.sum(-1).double()
        # per-row sums in float32, added up in float64: one float32 sum over n² products drifts
        sums["distance"] += torch.einsum("hij,ij->hi", a, _distances(n)).double().sum(-1)
        for name in ("entropy", "max_weight", "distance"):
            counts[name] += n
        for name, (queries, keys) in pattern_pairs(tuple(toks)).items():
            if len(queries) == 0:
                continue
            mass = torch.zeros(H, n, dtype=torch.float64)  # per query: weight on its targets
            mass.index_add_(1, queries, a[:, queries, keys].double())
            rows = torch.unique(queries)
            sums[name] += mass[:, rows].sum(-1)
            counts[name] += len(rows)
    return sums, counts


def add_sums(a: StatSums | None, b: StatSums) -> StatSums:
    if a is None:
        return b
    return ({name: a[0][name] + b[0][name] for name in a[0]},
            {name: a[1][name] + b[1][name] for name in a[1]})


def finish_stats(totals: StatSums, layer: int, first_head: int = 0) -> list[HeadStats]:
    """Means from sums and counts; heads numbered from first_head."""
    sums, counts = totals
    means: dict[str, Any] = {name: (sums[name] / counts[name]).tolist() if counts[name] else None
                             for name in sums}
    H = len(sums["entropy"])
    values: list[dict[str, Any]] = [
        {name: means[name][h] if means[name] is not None else None for name in sums}
        for h in range(H)]
    return [HeadStats(layer=layer, head=first_head + h, **values[h]) for h in range(H)]


def induction_score(weights: torch.Tensor, tokens: list[list[str]]) -> list[float]:
    """Per-head induction score of maps (B, H, L, S); a convenience for tests and reports."""
    return [s.induction or 0.0 for s in head_stats(weights, tokens, 0)]


# --- Statistics of maps computed in blocks of query rows -----------------------------------
#
# `row_terms` gives, for each query row of a block, its term of every sum `stat_sums` takes
# (its entropy, max weight, attended distance, weight on each pattern's keys), so that a map
# computed block by block never exists whole. Each term reads the block a fixed number of times
# and never builds an n × n array: distances through one skinny matmul, patterns by gathering
# their (query, key) pairs, generated block by block from the sentence's sorted tokens.

# total: Σ_j a_ij over all keys, bias_k included (a finiteness check; not a statistic)
ROW_TERMS = ("entropy", "max_weight", "distance", *PATTERNS, "special", "total")
DENSE_PAIRS = 16  # a block gathers duplicate pairs while they are < 1/16 of its entries


@dataclass(frozen=True)
class SentencePatterns:
    """One sentence's pattern structure, for any block of query rows: positions sorted by
    (token, position), so that the earlier copies of position i are
    order[group_start[i] : group_start[i] + copies[i]]."""

    token_ids: torch.Tensor  # (n,) int64
    order: torch.Tensor  # (n,) positions sorted by token, then position
    group_start: torch.Tensor  # (n,) where i's token starts in `order`
    copies: torch.Tensor  # (n,) earlier copies of i's token
    copies_cum: list[int]  # prefix sums of copies (host ints: block sizes without a device sync)
    special: torch.Tensor  # (n,) float32: 1 at special tokens ([CLS], </s>, …)
    counts: dict[str, int]  # queries each pattern averages over
    host: dict[str, Any]  # order, group_start, copies as numpy arrays, for pair generation

    def to(self, device: torch.device) -> SentencePatterns:
        return replace(self, token_ids=self.token_ids.to(device), order=self.order.to(device),
                       group_start=self.group_start.to(device), copies=self.copies.to(device),
                       special=self.special.to(device))


def sentence_patterns(tokens: tuple[str, ...]) -> SentencePatterns:
    n = len(tokens)
    ids = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    token_ids = torch.tensor([ids[t] for t in tokens], dtype=torch.long)
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
    repeat_prev = torch.zeros(n, dtype=torch.long)
    repeat_prev[1:] = (token_ids[1:] == token_ids[:-1]).long()
    special = torch.tensor([float(bool(SPECIAL_RE.match(t))) for t in tokens])
    counts = {"entropy": n, "max_weight": n, "distance": n, "first": n - 1, "previous": n - 1,
              "last": n - 1, "self": n, "duplicate": int((copies > 0).sum()),
              "induction": int((copies - repeat_prev > 0).sum()),
              "special": n if bool(special.any()) else 0, "total": n}
    cum = [0, *torch.cumsum(copies, 0).tolist()]
    host = {"order": order.numpy(), "group_start": group_start.numpy(), "copies": copies.numpy()}
    return SentencePatterns(token_ids, order, group_start, copies, cum, special, counts, host)


def row_terms(attn: torch.Tensor, row_start: int, keys: int, patterns: SentencePatterns,
              scores: torch.Tensor | None = None,
              row_max: torch.Tensor | None = None) -> torch.Tensor:
    """Each query row's term of every statistic, (len(ROW_TERMS), heads, r) float32.

    attn (heads, r, keys + extra): weights of the sentence's queries row_start .. row_start + r
    against its first `keys` real keys (every later real key has weight 0, as under a causal
    mask), then `extra` columns outside the real keys (bias_k), which count only in `total`.
    scores, optional: the pre-softmax scores (finite everywhere; where a mask zeroed a weight,
    any finite value), so that entropy needs no logarithm per entry; row_max (heads, r),
    optional with them: each row's largest unmasked score, which spares a search for it.
    """
    H, r, width = attn.shape
    device = attn.device
    real = attn[..., :keys]
    rows = torch.arange(r, device=device)
    queries = rows + row_start
    out = torch.zeros(len(ROW_TERMS), H, r, device=device)
    term = dict(zip(ROW_TERMS, out, strict=True))

    if scores is None:
        top = real.amax(-1)
        term["entropy"].sub_(torch.special.xlogy(real, real).sum(-1))  # 0 · log 0 = 0
    else:
        s = scores[..., :keys]
        # ln a_ij = s_ij - lse_i, and at the row's largest weight lse = s_max - ln a_max
        if row_max is None:
            top, top_index = real.max(-1)
            log_norm = s.gather(-1, top_index[..., None])[..., 0] - top.log()
        else:
            largest = attn.amax(-1)  # over every column: where the unmasked max score is
            top = largest if width == keys else real.amax(-1)
            log_norm = row_max - largest.log()
        dot = torch.einsum("hij,hij->hi", real, s)
    term["max_weight"].copy_(top)

    # Distances and row sums in one pass: Σ_j a_ij |i - j| split at the block's own keys into
    # keys left of it (|i - j| = i - j), right of it (j - i), and the r × r keys beside it,
    # measured from row_start so that float32 sums lose no precision on long rows.
    j = torch.arange(width, device=device)
    offset = (j - row_start).to(torch.float32)
    left = (j < row_start).to(torch.float32)
    right = ((j >= row_start + r) & (j < keys)).to(torch.float32)
    weights = torch.stack([torch.ones(width, device=device), left, left * offset, right,
                           right * offset], 1)  # (width, 5)
    sums = attn @ weights  # (H, r, 5)
    local = rows.to(torch.float32)
    stop = min(row_start + r, keys)
    beside = real[..., row_start:stop]  # (H, r, c)
    near = _near(r, stop - row_start, str(device))
    term["total"].copy_(sums[..., 0])
    term["distance"].copy_(local * sums[..., 1] - sums[..., 2] + sums[..., 4] - local * sums[..., 3]
                           + (beside * near).sum(-1))
    if scores is not None:
        mass = sums[..., 1] + sums[..., 3] + beside.sum(-1)  # Σ over real keys
        term["entropy"].copy_(torch.where(top > 0, log_norm * mass, 0.0) - dot)

    later = (queries >= 1).to(torch.float32)
    n = len(patterns.token_ids)
    if n - 1 < keys:  # under a causal mask no query before the last sees the last token
        term["last"].copy_(real[:, :, n - 1] * (queries < n - 1).to(torch.float32))
    term["special"].copy_(real @ patterns.special[:keys])
    term["self"].copy_(real[:, rows, queries])
    term["previous"].copy_(real[:, rows, (queries - 1).clamp(min=0)] * later)
    term["first"].copy_(real[:, :, 0] * later)
    _copy_terms(real, row_start, patterns, term["duplicate"], term["induction"])
    return out


def _copy_terms(real: torch.Tensor, row_start: int, patterns: SentencePatterns,
                duplicate: torch.Tensor, induction: torch.Tensor) -> None:
    """Each row's weight on earlier copies of its token, and on the tokens that followed them
    (j + 1 < i): gathered pair by pair while the pairs are few, else through a dense mask."""
    H, r, keys = real.shape
    device = real.device
    stop = row_start + r
    pairs = patterns.copies_cum[stop] - patterns.copies_cum[row_start]
    if pairs == 0:
        return
    if pairs * DENSE_PAIRS <= r * keys:
        local, key = _block_pairs(patterns, row_start, stop, pairs)
        local, key = local.to(device), key.to(device)
        duplicate.index_add_(1, local, real[:, local, key])
        follows = ((key + 1) < (row_start + local)).to(real.dtype)
        induction.index_add_(1, local, real[:, local, (key + 1).clamp(max=keys - 1)] * follows)
        return
    ids = patterns.token_ids
    queries = torch.arange(row_start, stop, device=device)
    j = torch.arange(keys, device=device)
    same = (ids[row_start:stop, None] == ids[None, :keys]) & (j < queries[:, None])  # (r, keys)
    duplicate.add_(torch.where(same, real, 0.0).sum(-1))
    after = torch.zeros_like(same)
    after[:, 1:] = same[:, :-1] & (j[1:] < queries[:, None])
    induction.add_(torch.where(after, real, 0.0).sum(-1))


def _block_pairs(patterns: SentencePatterns, start: int, stop: int,
                 pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-local query, key) of every earlier-copy pair of queries start..stop, on the host
    (numpy: single-threaded index arithmetic, no parallel region per block)."""
    import numpy as np

    copies = patterns.host["copies"][start:stop]
    local = np.repeat(np.arange(stop - start), copies)
    first = np.cumsum(copies) - copies
    nth = np.arange(pairs) - np.repeat(first, copies)
    key = patterns.host["order"][patterns.host["group_start"][start + local] + nth]
    return torch.from_numpy(local), torch.from_numpy(key)
