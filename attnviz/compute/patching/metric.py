"""The metric a patched run is scored by, and the normalized scale (0 = corrupted, 1 = clean).

- logit-diff: logit(answer) − logit(wrong) at the prompt's last token (Wang et al. 2022), in
  the model's own logits (softcapping and all: what its forward returns);
- logprob: log softmax(logits)[answer] at the prompt's last token;
- loss: the mean next-token loss (nats) over the answer taken as a continuation appended to
  both prompts (teacher forcing), lower = better.

Scores are float64 per row; a batch holds one row per pair, repeated per patched copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.compute.patching.pairs import TokenizedPair
from attnviz.core.choices import PatchMetric

EXPLAINED = {
    PatchMetric.LOGIT_DIFF: "logit(answer) − logit(wrong) at the prompt's last token",
    PatchMetric.LOGPROB: "log p(answer) at the prompt's last token",
    PatchMetric.LOSS: "mean next-token loss (nats) over the answer as a continuation",
}


@dataclass(frozen=True)
class Targets:
    """What the metric reads, per pair (P pairs, K read positions at most)."""

    metric: PatchMetric
    positions: torch.Tensor  # (P, K) long: the positions whose logits are read
    answers: torch.Tensor  # (P, K) long: the id scored at each (loss: the next token)
    wrong: torch.Tensor | None  # (P,) long: logit-diff's wrong id
    weights: torch.Tensor  # (P, K) float64: 1 where a read position is real

    @property
    def pairs(self) -> int:
        return int(self.positions.shape[0])


def inputs_of(pair: TokenizedPair, metric: PatchMetric, corrupt: bool) -> list[int]:
    """The ids a run reads: the prompt, and the continuation for the loss."""
    prompt = pair.corrupt if corrupt else pair.clean
    return prompt + pair.answer if metric is PatchMetric.LOSS else list(prompt)


def targets(pairs: list[TokenizedPair], metric: PatchMetric) -> Targets:
    """The read positions and scored ids of each pair."""
    K = max(len(p.answer) for p in pairs) if metric is PatchMetric.LOSS else 1
    P = len(pairs)
    positions = torch.zeros(P, K, dtype=torch.long)
    answers = torch.zeros(P, K, dtype=torch.long)
    weights = torch.zeros(P, K, dtype=torch.float64)
    for p, pair in enumerate(pairs):
        last = pair.prompt_length - 1
        scored = pair.answer if metric is PatchMetric.LOSS else pair.answer[:1]
        for j, token in enumerate(scored):  # logits at last + j predict the continuation's j-th
            positions[p, j], answers[p, j], weights[p, j] = last + j, token, 1.0
    wrong = None
    if metric is PatchMetric.LOGIT_DIFF:
        wrong = torch.tensor([p.wrong for p in pairs], dtype=torch.long)
    return Targets(metric, positions, answers, wrong, weights)


def score(read: torch.Tensor, targets: Targets) -> torch.Tensor:
    """(N,) float64: the metric of each row, `read` (N, K, V) the logits at the read positions
    of N = copies · P rows (copy-major: row c·P + p is pair p)."""
    N, K, _ = read.shape
    copies = N // targets.pairs
    logits = read.double()
    answers = targets.answers.to(logits.device).repeat(copies, 1)  # (N, K)
    weights = targets.weights.to(logits.device).repeat(copies, 1)
    if targets.metric is PatchMetric.LOGIT_DIFF:
        assert targets.wrong is not None
        wrong = targets.wrong.to(logits.device).repeat(copies)
        rows = torch.arange(N, device=logits.device)
        return logits[rows, 0, answers[:, 0]] - logits[rows, 0, wrong]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, answers[..., None])[..., 0]  # (N, K)
    if targets.metric is PatchMetric.LOGPROB:
        return logp[:, 0]
    return -(logp * weights).sum(-1) / weights.sum(-1)


def normalized(value: float, clean: float, corrupt: float) -> float | None:
    """(value − corrupted) / (clean − corrupted): 0 = the corrupted run, 1 = the clean run;
    None when the two baselines are equal (nothing to restore)."""
    scale = clean - corrupt
    if scale == 0 or not torch.isfinite(torch.tensor(scale)):
        return None
    return (value - corrupt) / scale
