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
  over sentences that have one;
- next: a_i,i+1 (queries i < n - 1): the token after the query (Clark et al., 2019; always 0 under
  a causal mask);
- punctuation: Σ a_ij over punctuation tokens j (`.` `,` `;` `:` `!` `?` `…` and their
  full-width forms, with a tokenizer's word markers Ġ ▁ ## stripped: PUNCTUATION), over
  sentences that have one.

A head is labelled by a pattern only when at least MIN_LABEL_QUERIES queries exercised it
(`HeadStats.queries` counts them): one repeated "the" does not make a head "induction".

Cross-attention maps (queries from one sequence, keys from another: an encoder-decoder's target
over its source) have entropy, max weight and first (a_i0, every query) only: distances and
the token patterns compare positions of one sequence.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

LABEL_THRESHOLD = 0.5  # a head is labelled when one pattern takes at least half its attention
MIN_LABEL_QUERIES = 4  # … over at least this many queries that exercised the pattern
PATTERNS = ("previous", "first", "last", "self", "duplicate", "induction", "next",
            "punctuation")
LABEL_NAMES = {"previous": "previous-token", "first": "first-token", "last": "last-token",
               "self": "self", "duplicate": "duplicate-token", "induction": "induction",
               "next": "next-token", "punctuation": "punctuation"}
PUNCTUATION = frozenset(".,;:!?…。，、；：！？")
_WORD_MARKERS = ("Ġ", "▁", "##", "Ċ")


def is_punctuation(token: str) -> bool:
    """A token of sentence punctuation only ('.', ',', '...', 'Ġ.', '▁;'), markers stripped."""
    for marker in _WORD_MARKERS:
        token = token.replace(marker, "")
    token = token.strip()
    return bool(token) and all(char in PUNCTUATION for char in token)
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
    next: float | None = None  # None when every sentence is one token long (or cross-attention)
    punctuation: float | None = None  # None when no sentence has a punctuation token
    # (pattern, queries that exercised it) — () when not counted (then every pattern counts)
    queries: tuple[tuple[str, int], ...] = ()

    def exercised(self, pattern: str) -> bool:
        """Whether enough queries exercised `pattern` to name the head by it."""
        counts = dict(self.queries)
        return pattern not in counts or counts[pattern] >= MIN_LABEL_QUERIES

    @property
    def label(self) -> str:
        """The pattern holding ≥ LABEL_THRESHOLD of the attention over at least
        MIN_LABEL_QUERIES queries, or "" (the strongest wins)."""
        scores = {name: getattr(self, name) for name in PATTERNS if self.exercised(name)}
        found = [(s, n) for n, s in scores.items() if s is not None]
        if not found:
            return ""
        best = max(found)
        return LABEL_NAMES[best[1]] if best[0] >= LABEL_THRESHOLD else ""

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc["queries"] = dict(self.queries)
        return {**doc, "label": self.label}


def xlogx_rows(a: torch.Tensor) -> torch.Tensor:
    """Σ_j a_ij ln a_ij over the last axis of float32 weights (0 · ln 0 = 0), as
    torch.special.xlogy(a, a).sum(-1) but about twice as fast on a CPU: the logarithm is taken
    of max(a, 2⁻¹²⁶), so that it never meets a 0 or a subnormal, which the vectorized log
    handles several times slower (and xlogy's special case for 0 slower still). A weight of 0
    still adds 0 · ln 2⁻¹²⁶ = 0; a subnormal one (< 2⁻¹²⁶) adds at most 16 · a < 2⁻¹²² less
    than a ln a. A row with a negative weight (not a distribution) is NaN, as under xlogy."""
    if a.dtype not in (torch.float32, torch.float64):  # half precision's tiny is 6e-5
        a = a.float()
    terms = a.clamp_min(torch.finfo(a.dtype).tiny).log_().mul_(a).sum(-1)
    return torch.where(a.amin(-1) < 0, torch.nan, terms)


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
    marks = torch.tensor([is_punctuation(t) for t in tokens])
    punct_q, punct_k = marks[None, :].expand(n, n).nonzero(as_tuple=True)
    return {
        "previous": (positions[1:], positions[:-1]),
        "first": (positions[1:], torch.zeros(n - 1, dtype=torch.long)),
        "last": (positions[:-1], torch.full((n - 1,), n - 1, dtype=torch.long)),
        "special": (special_q, special_k),
        "self": (positions, positions),
        "duplicate": (dup_q, dup_k),
        "induction": (dup_q[keep], dup_k[keep] + 1),
        "next": (positions[:-1], positions[1:]),
        "punctuation": (punct_q, punct_k),
    }


@functools.lru_cache(maxsize=2)
def _distances(n: int) -> torch.Tensor:
    """|i - j| for an n × n map."""
    pos = torch.arange(n, dtype=torch.float32)
    return (pos[:, None] - pos[None, :]).abs()


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
        sums["entropy"] -= xlogx_rows(a).sum(-1).double()
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
        if scores is None:
            top = a.amax(-1)  # (H, n)
            # head by head: (n, n) temporaries, not (H, n, n)
            sums["entropy"] -= torch.stack([xlogx_rows(m).sum() for m in a]).double()
        else:
            top, top_index = a.max(-1)  # (H, n)
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
    means: dict[str, list[float] | None] = {
        name: (sums[name] / counts[name]).tolist() if counts[name] else None for name in sums}
    H = len(sums["entropy"])
    values: list[dict[str, Any]] = [
        {name: None if (mean := means[name]) is None else mean[h] for name in sums}
        for h in range(H)]
    queries = tuple((name, int(counts[name])) for name in (*PATTERNS, "special")
                    if name in counts)
    return [HeadStats(layer=layer, head=first_head + h, queries=queries, **values[h])
            for h in range(H)]
