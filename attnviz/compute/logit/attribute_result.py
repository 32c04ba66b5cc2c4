"""The results of `attnviz attribute` (direct logit attribution), as the use case returns them
and the renderers draw them: plain numbers per prompt, per part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONVENTIONS = [
    "a part's value is u · (gain ⊙ center(part) / σ): u = W_U[answer] − W_U[wrong] (or "
    "W_U[answer]), the final norm's gain and centering (LayerNorm; none for RMSNorm), σ frozen "
    "at this run's final residual",
    "the sum of the parts adds the final norm's bias and the unembedding's bias, each counted "
    "once; a head's part is its slice of W_O's input through its W_O columns, W_O's bias a "
    "part of its own",
    "remainder = the model's own metric − the sum of the parts (float round-off only)",
]


PART_FIELDS = ("embed", "attn", "mlp", "heads", "attn_bias", "norm_bias", "head_bias", "total",
               "target", "remainder", "cross", "cross_heads", "cross_bias")


@dataclass(frozen=True)
class Parts:
    """One prompt's parts (floats): the metric's direct contributions."""

    embed: float
    attn: list[float]  # per layer
    mlp: list[float] | None
    heads: list[list[float]] | None  # [layer][head]
    attn_bias: list[float] | None  # per layer: W_O's bias
    norm_bias: float
    head_bias: float
    total: float
    target: float  # the model's own metric (before a softcap)
    remainder: float
    cross: list[float] | None = None  # per decoder layer: cross-attention (encoder-decoders)
    cross_heads: list[list[float]] | None = None
    cross_bias: list[float] | None = None

    def named(self) -> list[tuple[str, float]]:
        """Every part with its label, the finest split: heads and W_O biases in place of the
        attention outputs they sum to."""
        rows = [("embeddings", self.embed)]
        for layer, value in enumerate(self.attn):
            if self.heads is None:
                rows.append((f"L{layer} attn", value))
            else:
                rows += [(f"L{layer}H{h}", v) for h, v in enumerate(self.heads[layer])]
                if self.attn_bias is not None:
                    rows.append((f"L{layer} W_O bias", self.attn_bias[layer]))
            if self.cross is not None and self.cross_heads is None:
                rows.append((f"L{layer} cross", self.cross[layer]))
            elif self.cross_heads is not None:
                rows += [(f"L{layer}X{h}", v) for h, v in enumerate(self.cross_heads[layer])]
                if self.cross_bias is not None:
                    rows.append((f"L{layer} cross W_O bias", self.cross_bias[layer]))
            if self.mlp is not None:
                rows.append((f"L{layer} MLP", self.mlp[layer]))
        return rows + [("final norm bias", self.norm_bias), ("unembedding bias", self.head_bias)]

    def largest(self, top: int) -> list[tuple[str, float]]:
        """The `top` parts of largest magnitude, named."""
        return sorted(self.named(), key=lambda row: -abs(row[1]))[:top]

    def to_json(self) -> dict[str, Any]:
        return {"embeddings": self.embed, "attention": self.attn, "mlp": self.mlp,
                "heads": self.heads, "wo_bias": self.attn_bias,
                "final_norm_bias": self.norm_bias, "unembedding_bias": self.head_bias,
                "sum": self.total, "model_metric": self.target, "remainder": self.remainder,
                "cross_attention": self.cross, "cross_heads": self.cross_heads,
                "cross_wo_bias": self.cross_bias}


@dataclass(frozen=True)
class PromptAttribution:
    prompt: str
    tokens: list[str]
    position: int
    answer: tuple[int, str]
    wrong: tuple[int, str] | None
    scale: float  # the final norm's frozen 1/σ
    model_metric: float  # the model's own metric (after its logit transform)
    parts: Parts
    corrupt: PromptAttribution | None = None
    difference: Parts | None = None  # clean − corrupted

    def to_json(self, top: int) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "prompt": self.prompt, "tokens": self.tokens, "position": self.position,
            "answer": {"id": self.answer[0], "token": self.answer[1]},
            "wrong": None if self.wrong is None else {"id": self.wrong[0],
                                                       "token": self.wrong[1]},
            "final_norm_scale": self.scale, "model_metric_after_transform": self.model_metric,
            "parts": self.parts.to_json(), "largest": _largest(self.parts, top)}
        if self.corrupt is not None and self.difference is not None:
            doc["corrupt"] = self.corrupt.to_json(top)
            doc["difference_clean_minus_corrupt"] = self.difference.to_json()
            doc["largest_difference"] = _largest(self.difference, top)
        return doc


def _largest(parts: Parts, top: int) -> list[dict[str, Any]]:
    """The `top` parts of largest magnitude, named (heads and W_O biases split out)."""
    return [{"part": name, "value": value} for name, value in parts.largest(top)]


@dataclass(frozen=True)
class AttributeResult:
    model: str
    metric: str  # in words
    norm: str  # the final norm's kind and module
    transform: str  # the logit transform after the head
    softcapped: bool  # the attribution is to the logit before the softcap
    prompts: list[PromptAttribution]
    top: int
    notes: list[str]

    def mean(self) -> tuple[Parts, list[list[float]] | None] | None:
        """Over the prompts (of the clean − corrupted differences, where given): the mean of
        every part, and the heads' standard deviation; None for a single prompt."""
        if len(self.prompts) < 2:
            return None
        each = [p.difference if p.difference is not None else p.parts for p in self.prompts]
        return mean_parts([p for p in each if p is not None])

    def to_json(self) -> dict[str, Any]:
        summary = self.mean()
        return {"command": "attribute", "model": self.model, "metric": self.metric,
                "final_norm": self.norm, "final_norm_scale": "frozen at each run's own final "
                "residual (1/sigma, per prompt)", "logit_transform": self.transform,
                "attributed_before_softcap": self.softcapped, "conventions": CONVENTIONS,
                "prompts": [p.to_json(self.top) for p in self.prompts],
                "mean_over_prompts": None if summary is None else
                {"parts": summary[0].to_json(), "heads_std": summary[1],
                 "of": "clean − corrupted" if self.prompts[0].difference is not None
                 else "clean"},
                "notes": self.notes}


def mean_parts(parts: list[Parts]) -> tuple[Parts, list[list[float]] | None]:
    """Part by part: the mean over `parts`, and the heads' population standard deviation."""
    n = len(parts)

    def mean(values: list[Any]) -> Any:
        if values[0] is None:
            return None
        if isinstance(values[0], list):
            return [mean([v[i] for v in values]) for i in range(len(values[0]))]
        return sum(values) / n

    def std(values: list[Any]) -> Any:
        if isinstance(values[0], list):
            return [std([v[i] for v in values]) for i in range(len(values[0]))]
        m = sum(values) / n
        return (sum((v - m) ** 2 for v in values) / n) ** 0.5

    averaged = Parts(*(mean([getattr(p, f) for p in parts]) for f in PART_FIELDS))
    heads = None if parts[0].heads is None else std([p.heads for p in parts])
    return averaged, heads
