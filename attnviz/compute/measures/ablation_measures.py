"""What removing one head does to a model's output (Michel et al. 2019, "Are Sixteen Heads Really
Better than One?"): the measures of a causal head scorecard, and its result.

A head is removed by zeroing its slice of the input to W_O (`zero`), or by replacing that slice
with its mean over the batch's real tokens (`mean`), in one copy of the batch; the model's own
forward then runs on the copies, stacked along the batch dimension as many at once as the memory
budget holds (attnviz.sources.copy_budget). Measures,
all over real tokens only:

- hidden_change: mean over tokens of ‖h′_t − h_t‖ / ‖h_t‖, h the model's final hidden states;
- loss_change (a causal LM head): mean next-token loss with the head removed minus without;
  repeat_loss_change the same over the tokens that repeat an earlier token of their sentence
  (those an induction head can predict: the second half of `--probe induction`);
- loss_change (a masked LM or seq2seq LM head): mean KL(p ‖ p′) of the output distributions.

Losses, divergences and their differences are computed in float64 from the logits (the
differences of two nearly equal means lose float32's digits). A measure the input does not
define (no next token to predict when every sentence has one token) is None, its reason in
`AblationReport.undefined`, and is never ranked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from attnviz.core.choices import AblationMode

MODES = AblationMode.values()
CAUSAL_LOSS = "next-token loss"
KL = "KL divergence"
NO_NEXT_TOKEN = "no next token to predict: every sentence has one token"
NO_REPEAT = "no token repeats an earlier token of its sentence"
MEANINGS = {"loss change": "rise of the next-token loss when the head is removed",
            "KL": "KL divergence of the outputs when the head is removed",
            "hidden change": "relative change of the final hidden states when removed"}


@dataclass(frozen=True)
class HeadEffect:
    layer: int  # the layer's index, as the run numbers it
    label: str  # the layer as the run labels it ("3", "enc 0")
    head: int
    hidden_change: float
    loss_change: float | None = None  # None without an LM head, or undefined
    repeat_loss_change: float | None = None  # causal LM, tokens repeating an earlier one

    def to_json(self) -> dict[str, Any]:
        # a non-finite value would be written as NaN, which is not JSON: null, as undefined
        return {"layer": self.layer, "label": self.label, "head": self.head,
                "hidden_change": defined(self.hidden_change),
                "loss_change": defined(self.loss_change),
                "repeat_loss_change": defined(self.repeat_loss_change)}


def defined(value: float | None) -> float | None:
    """The value, or None where it is undefined (None, NaN or infinite)."""
    return value if value is not None and math.isfinite(value) else None


@dataclass
class AblationReport:
    mode: str  # "zero" or "mean"
    loss_kind: str | None  # CAUSAL_LOSS, KL, or None (no LM head)
    effects: list[HeadEffect]
    base_loss: float | None = None  # causal LM: the mean next-token loss with every head
    base_repeat_loss: float | None = None
    copies_per_forward: int = 1  # the most heads stacked along the batch in one forward
    notes: list[str] = field(default_factory=list)
    # measure field ("loss_change", "repeat_loss_change") → why this input leaves it undefined
    undefined: dict[str, str] = field(default_factory=dict)

    def effect(self, layer: int, head: int) -> HeadEffect | None:
        return next((e for e in self.effects if (e.layer, e.head) == (layer, head)), None)

    @property
    def ranked_field(self) -> str:
        """The measure that ranks heads: the loss change with an LM head where this input
        defines it, else the hidden change."""
        if self.loss_kind is not None and "loss_change" not in self.undefined and \
                any(defined(e.loss_change) is not None for e in self.effects):
            return "loss_change"
        return "hidden_change"

    @property
    def fallback(self) -> str | None:
        """Why the ranking falls back to the hidden change (None where it does not)."""
        if self.loss_kind is None or self.ranked_field == "loss_change":
            return None
        why = self.undefined.get("loss_change", "undefined for every head")
        return f"by the hidden change, the {self.loss_measure} being undefined: {why}"

    def score(self, effect: HeadEffect) -> float | None:
        """The ranking measure of one head; None where undefined (never ranked)."""
        return defined(getattr(effect, self.ranked_field))

    def ranked(self) -> list[HeadEffect]:
        """The heads with a defined score, largest first (ties: lower layer, head)."""
        scored = [(score, e) for e in self.effects if (score := self.score(e)) is not None]
        scored.sort(key=lambda item: (-item[0], item[1].layer, item[1].head))
        return [e for _, e in scored]

    @property
    def loss_measure(self) -> str:
        return "loss change" if self.loss_kind == CAUSAL_LOSS else "KL"

    @property
    def measure(self) -> str:
        return self.loss_measure if self.ranked_field == "loss_change" else "hidden change"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "loss_kind": self.loss_kind,
                "base_loss": defined(self.base_loss),
                "base_repeat_loss": defined(self.base_repeat_loss), "notes": self.notes,
                "ranked_by": self.measure, "undefined": dict(self.undefined)}


def hidden_change(base: torch.Tensor, other: torch.Tensor, real: torch.Tensor) -> float:
    """Mean over real tokens of ‖other_t − base_t‖ / ‖base_t‖; base, other (B, L, E), real
    (B, L) bool."""
    base, other = base.double(), other.double()
    delta = (other - base).norm(dim=-1)  # (B, L)
    size = base.norm(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    return float((delta / size)[real.to(delta.device)].mean())


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


def next_token_losses(logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor,
                      repeats: torch.Tensor | None = None) -> tuple[float | None, float | None]:
    """(mean next-token cross-entropy over real positions t whose t+1 is real, the same over
    `repeat_targets`), in float64; None where no position qualifies (NO_NEXT_TOKEN,
    NO_REPEAT); logits (B, L, V), ids and real (B, L); real tokens contiguous. `repeats`:
    repeat_targets(ids, real), given where many copies share the ids (a Python loop)."""
    predicts = (real[:, :-1] & real[:, 1:]).cpu()  # (B, L-1)
    if repeats is None:
        repeats = repeat_targets(ids.cpu(), real.cpu())
    repeats = repeats[:, :-1] & predicts
    if not bool(predicts.any()):
        return None, None
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].double().transpose(1, 2), ids[:, 1:].to(logits.device),
        reduction="none").cpu()  # (B, L-1)
    mean = float(losses[predicts].mean())
    repeat = float(losses[repeats].mean()) if bool(repeats.any()) else None
    return mean, repeat


def difference(value: float | None, base: float | None) -> float | None:
    """value − base, None where either is undefined."""
    return None if value is None or base is None else value - base


def kl_divergence(base_logits: torch.Tensor, other_logits: torch.Tensor,
                  real: torch.Tensor) -> float:
    """Mean over real positions of KL(p ‖ p′), p = softmax(base_logits), in float64."""
    log_p = torch.log_softmax(base_logits.double(), -1)
    log_q = torch.log_softmax(other_logits.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, L)
    return float(kl[real.to(kl.device)].mean())


def undefined_measures(loss_kind: str | None, base_loss: float | None,
                       base_repeat: float | None) -> dict[str, str]:
    """The measures a causal LM's input leaves undefined, with the reason."""
    if loss_kind != CAUSAL_LOSS:
        return {}
    if base_loss is None:
        return {"loss_change": NO_NEXT_TOKEN, "repeat_loss_change": NO_NEXT_TOKEN}
    return {"repeat_loss_change": NO_REPEAT} if base_repeat is None else {}
