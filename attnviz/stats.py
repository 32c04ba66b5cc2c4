"""Per-head statistics of attention maps, and labels for heads that clearly do one thing.

All statistics average over the real (non-padding) query positions of every sentence:
- entropy: -Σ_j a_ij ln a_ij (nats);  max weight: max_j a_ij;
- distance: Σ_j a_ij |i - j| (mean attended distance, in tokens);
- first: a_i0 (queries i ≥ 1);  previous: a_i,i-1 (i ≥ 1);  self: a_ii;
- duplicate: Σ a_ij over earlier j with token_j = token_i (queries that repeat a token);
- induction: Σ a_i,j+1 over earlier j with token_j = token_i and j + 1 < i (the token that
  followed the earlier occurrence; Olsson et al., 2022), over queries that repeat a token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

LABEL_THRESHOLD = 0.5  # a head is labelled when one pattern takes at least half its attention
PATTERNS = ("previous", "first", "self", "duplicate", "induction")
LABEL_NAMES = {"previous": "previous-token", "first": "first-token", "self": "self",
               "duplicate": "duplicate-token", "induction": "induction"}


@dataclass(frozen=True)
class HeadStats:
    layer: int
    head: int
    entropy: float
    max_weight: float
    distance: float
    first: float
    previous: float
    self: float
    duplicate: float | None  # None when no sentence repeats a token
    induction: float | None

    @property
    def label(self) -> str:
        """The pattern holding ≥ LABEL_THRESHOLD of the attention, or "" (the strongest wins)."""
        scores = {name: getattr(self, name) for name in PATTERNS}
        best = max((s, n) for n, s in scores.items() if s is not None)
        return LABEL_NAMES[best[1]] if best[0] >= LABEL_THRESHOLD else ""

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "label": self.label}


def pattern_masks(tokens: list[str]) -> dict[str, torch.Tensor]:
    """(n, n) bool masks of the keys each pattern points at, for one unpadded sentence."""
    n = len(tokens)
    ids = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    token_ids = torch.tensor([ids[t] for t in tokens])
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)  # key j < query i
    same = (token_ids[:, None] == token_ids[None, :]) & earlier
    # induction target (i, j+1) for every earlier copy j of token i, with j + 1 < i
    induction = torch.zeros(n, n, dtype=torch.bool)
    induction[:, 1:] = same[:, :-1]
    induction &= earlier
    eye = torch.eye(n, dtype=torch.bool)
    first = torch.zeros(n, n, dtype=torch.bool)
    first[1:, 0] = True
    return {"previous": eye.roll(-1, 1) & earlier if n > 1 else eye & earlier, "first": first,
            "self": eye, "duplicate": same, "induction": induction}


def head_stats(weights: torch.Tensor, tokens: list[list[str]], layer: int) -> list[HeadStats]:
    """Statistics of maps (B, H, L, S) for sentences with the given (unpadded) tokens."""
    H = weights.shape[1]
    sums = {name: torch.zeros(H, dtype=torch.float64) for name in
            ("entropy", "max_weight", "distance", *PATTERNS)}
    counts = dict.fromkeys(sums, 0)
    for b, toks in enumerate(tokens):
        n = len(toks)
        a = weights[b, :, :n, :n].float()  # (H, n, n) real queries and keys only
        pos = torch.arange(n, dtype=torch.float32)
        plogp = torch.special.xlogy(a, a)  # 0 · log 0 = 0
        sums["entropy"] += -plogp.sum((-1, -2)).double()
        del plogp
        sums["max_weight"] += a.amax(-1).sum(-1).double()
        sums["distance"] += (a * (pos[:, None] - pos[None, :]).abs()).sum((-1, -2)).double()
        for name in ("entropy", "max_weight", "distance"):
            counts[name] += n
        for name, mask in pattern_masks(toks).items():
            rows = mask.any(-1)  # queries for which this pattern exists
            sums[name] += (a * mask).sum(-1)[:, rows].sum(-1).double()
            counts[name] += int(rows.sum())
    means = {name: (sums[name] / counts[name]).tolist() if counts[name] else None
             for name in sums}
    return [HeadStats(layer=layer, head=h, **{
        name: means[name][h] if means[name] is not None else None for name in sums})
        for h in range(H)]


def induction_score(weights: torch.Tensor, tokens: list[list[str]]) -> list[float]:
    """Per-head induction score of maps (B, H, L, S); a convenience for tests and reports."""
    return [s.induction or 0.0 for s in head_stats(weights, tokens, 0)]
