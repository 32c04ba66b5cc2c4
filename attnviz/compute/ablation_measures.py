"""What removing one head does to a model's output (Michel et al. 2019, "Are Sixteen Heads Really
Better than One?"): the measures of a causal head scorecard, and its result.

A head is removed by zeroing its slice of the input to W_O (`zero`), or by replacing that slice
with its mean over the batch's real tokens (`mean`), in one copy of the batch; the model's own
forward then runs on every copy at once (heads stacked along the batch dimension). Measures,
all over real tokens only:

- hidden_change: mean over tokens of ‖h′_t − h_t‖ / ‖h_t‖, h the model's final hidden states;
- loss_change (a causal LM head): mean next-token loss with the head removed minus without;
  repeat_loss_change the same over the tokens that repeat an earlier token of their sentence
  (those an induction head can predict: the second half of `--probe induction`);
- loss_change (a masked LM or seq2seq LM head): mean KL(p ‖ p′) of the output distributions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

MODES = ("zero", "mean")
CAUSAL_LOSS = "next-token loss"
KL = "KL divergence"


@dataclass(frozen=True)
class HeadEffect:
    layer: int  # the layer's index, as the run numbers it
    label: str  # the layer as the run labels it ("3", "enc 0")
    head: int
    hidden_change: float
    loss_change: float | None = None  # None without an LM head
    repeat_loss_change: float | None = None  # causal LM, tokens repeating an earlier one

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "label": self.label, "head": self.head,
                "hidden_change": self.hidden_change, "loss_change": self.loss_change,
                "repeat_loss_change": self.repeat_loss_change}


@dataclass
class AblationReport:
    mode: str  # "zero" or "mean"
    loss_kind: str | None  # CAUSAL_LOSS, KL, or None (no LM head)
    effects: list[HeadEffect]
    base_loss: float | None = None  # causal LM: the mean next-token loss with every head
    base_repeat_loss: float | None = None
    copies_per_forward: int = 1  # heads stacked along the batch in one forward pass
    notes: list[str] = field(default_factory=list)

    def effect(self, layer: int, head: int) -> HeadEffect | None:
        return next((e for e in self.effects if (e.layer, e.head) == (layer, head)), None)

    def score(self, effect: HeadEffect) -> float:
        """What ranks heads: the loss change with an LM head, else the hidden change."""
        if self.loss_kind is not None and effect.loss_change is not None:
            return effect.loss_change
        return effect.hidden_change

    @property
    def measure(self) -> str:
        return "loss change" if self.loss_kind == CAUSAL_LOSS else \
            "KL" if self.loss_kind == KL else "hidden change"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "loss_kind": self.loss_kind, "base_loss": self.base_loss,
                "base_repeat_loss": self.base_repeat_loss, "notes": self.notes}


def hidden_change(base: torch.Tensor, other: torch.Tensor, real: torch.Tensor) -> float:
    """Mean over real tokens of ‖other_t − base_t‖ / ‖base_t‖; base, other (B, L, E), real
    (B, L) bool."""
    delta = (other.float() - base.float()).norm(dim=-1)  # (B, L)
    size = base.float().norm(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    return float((delta / size)[real].mean())


def repeat_targets(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: position t whose next real token repeats an earlier token of the sentence
    (its id occurred at some j ≤ t)."""
    B, L = ids.shape
    out = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        positions = real[b].nonzero().flatten().tolist()
        seen: set[int] = set()
        for t, nxt in zip(positions, positions[1:], strict=False):
            seen.add(int(ids[b, t]))
            out[b, t] = int(ids[b, nxt]) in seen
    return out


def next_token_losses(logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor
                      ) -> tuple[float, float | None]:
    """(mean next-token cross-entropy over real positions t whose t+1 is real, the same over
    `repeat_targets`); logits (B, L, V), ids and real (B, L); real tokens contiguous."""
    predicts = real[:, :-1] & real[:, 1:]  # (B, L-1)
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), ids[:, 1:].to(logits.device),
        reduction="none").cpu()  # (B, L-1)
    repeats = repeat_targets(ids.cpu(), real.cpu())[:, :-1] & predicts.cpu()
    mean = float(losses[predicts.cpu()].mean()) if bool(predicts.any()) else float("nan")
    repeat = float(losses[repeats].mean()) if bool(repeats.any()) else None
    return mean, repeat


def kl_divergence(base_logits: torch.Tensor, other_logits: torch.Tensor,
                  real: torch.Tensor) -> float:
    """Mean over real positions of KL(p ‖ p′), p = softmax(base_logits)."""
    log_p = torch.log_softmax(base_logits.float(), -1)
    log_q = torch.log_softmax(other_logits.float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, L)
    return float(kl[real.to(kl.device)].mean())
