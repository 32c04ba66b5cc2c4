"""The logit lens on tensors: given each layer's logits at chosen positions (each layer's
residual through the model's own final norm — its own statistics — and unembedding), the top
tokens and the answer's rank and probability per layer × position.

Rows: r = 0 is the embeddings (the residual entering layer 0), r = l + 1 the residual after
layer l; the last row is the model's own output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LensGrid:
    """One prompt's lens: R rows (embeddings, then each layer) × P positions."""

    positions: list[int]  # token positions of the columns
    top_ids: torch.Tensor  # (R, P, k) the most likely ids, best first
    top_probs: torch.Tensor  # (R, P, k) their probabilities
    answer: int | None  # the answer's id, if one was asked for
    answer_rank: torch.Tensor | None  # (R, P) 1 = the most likely
    answer_prob: torch.Tensor | None  # (R, P)

    @property
    def rows(self) -> int:
        return int(self.top_ids.shape[0])


def lens_grid(rows: Iterable[torch.Tensor], positions: list[int], answer: int | None, k: int
              ) -> LensGrid:
    """The grid of each row's logits (P, V), one row at a time, in float64: softmax over
    the vocabulary per cell."""
    ids, tops, ranks, probs_of = [], [], [], []
    for row in rows:
        logits = row.double()
        probs = torch.softmax(logits, dim=-1)  # (P, V)
        top_probs, top_ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
        ids.append(top_ids)
        tops.append(top_probs)
        if answer is not None:
            own = logits[:, answer]  # (P,)
            ranks.append(1 + (logits > own[:, None]).sum(-1))
            probs_of.append(probs[:, answer])
    rank = torch.stack(ranks) if answer is not None else None
    prob = torch.stack(probs_of) if answer is not None else None
    return LensGrid(list(positions), torch.stack(ids), torch.stack(tops), answer, rank, prob)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(logits / cap), as Gemma-2 caps its final logits (None: unchanged)."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def uncap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The logits before `softcap` (its inverse, in float64)."""
    if cap is None:
        return logits
    return cap * torch.atanh((logits.double() / cap).clamp(-1.0, 1.0))
